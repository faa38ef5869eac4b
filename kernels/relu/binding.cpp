// relu as Torch ops: schemas, input checks, CPU and CUDA implementations.
//
//   relu(x) -> y
//   relu_mask(x) -> (y, mask)                  y as relu; mask: the sign bits the backward needs (relu_mask.h)
//   relu_mask_backward(grad_y, mask) -> grad_x grad_y where the bit is 1, else 0
#include <opbuilder/binding.h>

#include <cstdint>
#include <tuple>

#include "relu_cpu.h"
#include "relu_mask.h"
#ifdef OPB_WITH_CUDA
#include "relu.cuh"
#endif

namespace {

namespace relu = opb::relu;

constexpr const char* kOp = "relu";
constexpr const char* kMask = "relu_mask";
constexpr const char* kBwd = "relu_mask_backward";

at::Tensor prepare(const char* op, const at::Tensor& x) {
  opb::dtype_of(x, op, "x");
  return x.contiguous();
}

at::Tensor new_mask(const at::Tensor& x) {
  return x.new_empty({relu::mask_words(x.numel(), x.element_size())}, x.options().dtype(at::kInt));
}

struct BwdInputs {
  at::Tensor dy, mask;
};

// The mask must be what relu_mask made for a tensor of grad_y's size and dtype.
BwdInputs prepare_backward(const at::Tensor& grad_y, const at::Tensor& mask) {
  opb::dtype_of(grad_y, kBwd, "grad_y");
  TORCH_CHECK(mask.scalar_type() == at::kInt, kBwd, ": mask must be int32 (from relu_mask), got ", mask.scalar_type());
  TORCH_CHECK(mask.device() == grad_y.device(), kBwd, ": mask must be on grad_y's device ", grad_y.device(), ", got ",
              mask.device());
  const int64_t words = relu::mask_words(grad_y.numel(), grad_y.element_size());
  TORCH_CHECK(mask.dim() == 1 && mask.size(0) == words, kBwd, ": mask must have shape [", words, "] for ",
              grad_y.numel(), " ", grad_y.scalar_type(), " elements, got ", mask.sizes());
  at::Tensor m = mask.contiguous();
  // The GPU reads a tile's words with 16-byte loads.
  if (reinterpret_cast<uintptr_t>(m.const_data_ptr()) % 16 != 0) m = m.clone();
  return {grad_y.contiguous(), m};
}

at::Tensor relu_cpu(const at::Tensor& x) {
  at::Tensor xc = prepare(kOp, x);
  at::Tensor y = opb::new_output(xc);
  relu::relu_cpu(xc.const_data_ptr(), y.mutable_data_ptr(), xc.numel(), opb::dtype_of(xc, kOp, "x"));
  return y;
}

std::tuple<at::Tensor, at::Tensor> relu_mask_cpu(const at::Tensor& x) {
  at::Tensor xc = prepare(kMask, x);
  at::Tensor y = opb::new_output(xc);
  at::Tensor mask = new_mask(xc);
  relu::relu_mask_cpu(xc.const_data_ptr(), y.mutable_data_ptr(), mask.mutable_data_ptr(), xc.numel(),
                      opb::dtype_of(xc, kMask, "x"));
  return {y, mask};
}

at::Tensor relu_mask_backward_cpu(const at::Tensor& grad_y, const at::Tensor& mask) {
  BwdInputs in = prepare_backward(grad_y, mask);
  at::Tensor dx = opb::new_output(in.dy);
  relu::relu_mask_backward_cpu(in.dy.const_data_ptr(), in.mask.const_data_ptr(), dx.mutable_data_ptr(),
                               in.dy.numel(), opb::dtype_of(in.dy, kBwd, "grad_y"));
  return dx;
}

#ifdef OPB_WITH_CUDA
at::Tensor relu_cuda(const at::Tensor& x) {
  at::Tensor xc = prepare(kOp, x);
  c10::cuda::CUDAGuard guard(xc.device());
  at::Tensor y = opb::new_output(xc);
  opb::check_launch(relu::launch(xc.const_data_ptr(), y.mutable_data_ptr(), xc.numel(), opb::dtype_of(xc, kOp, "x"),
                                 opb::stream_of(xc)),
                    kOp);
  return y;
}

std::tuple<at::Tensor, at::Tensor> relu_mask_cuda(const at::Tensor& x) {
  at::Tensor xc = prepare(kMask, x);
  c10::cuda::CUDAGuard guard(xc.device());
  at::Tensor y = opb::new_output(xc);
  at::Tensor mask = new_mask(xc);
  opb::check_launch(relu::launch_mask(xc.const_data_ptr(), y.mutable_data_ptr(), mask.mutable_data_ptr(), xc.numel(),
                                      opb::dtype_of(xc, kMask, "x"), opb::stream_of(xc)),
                    kMask);
  return {y, mask};
}

at::Tensor relu_mask_backward_cuda(const at::Tensor& grad_y, const at::Tensor& mask) {
  BwdInputs in = prepare_backward(grad_y, mask);
  c10::cuda::CUDAGuard guard(in.dy.device());
  at::Tensor dx = opb::new_output(in.dy);
  opb::check_launch(relu::launch_mask_backward(in.dy.const_data_ptr(), in.mask.const_data_ptr(), dx.mutable_data_ptr(),
                                               in.dy.numel(), opb::dtype_of(in.dy, kBwd, "grad_y"),
                                               opb::stream_of(in.dy)),
                    kBwd);
  return dx;
}
#endif

}  // namespace

OPB_LIBRARY(m) {
  m.def("relu(Tensor x) -> Tensor");
  m.def("relu_mask(Tensor x) -> (Tensor, Tensor)");
  m.def("relu_mask_backward(Tensor grad_y, Tensor mask) -> Tensor");
}

OPB_LIBRARY_IMPL(CPU, m) {
  m.impl("relu", &relu_cpu);
  m.impl("relu_mask", &relu_mask_cpu);
  m.impl("relu_mask_backward", &relu_mask_backward_cpu);
}

#ifdef OPB_WITH_CUDA
OPB_LIBRARY_IMPL(CUDA, m) {
  m.impl("relu", &relu_cuda);
  m.impl("relu_mask", &relu_mask_cuda);
  m.impl("relu_mask_backward", &relu_mask_backward_cuda);
}
#endif
