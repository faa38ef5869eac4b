// relu as Torch ops on the LibTorch stable ABI: schemas, input checks, CPU and CUDA implementations.
//
//   relu(x) -> y
//   relu.nograd(x) -> y                        relu with no autograd formula: what a call that records no
//                                              gradient takes (ops/relu.py registers none for it)
//   relu_mask(x) -> (y, mask)                  y as relu; mask: the sign bits the backward needs (relu_mask.h)
//   relu_mask.nograd(x) -> (y, mask)           relu_mask with no autograd formula: what the forward of a call
//                                              that needs a gradient runs inside its autograd.Function
//   relu_mask_backward(grad_y, mask) -> grad_x grad_y where the bit is 1, else 0
#include <opbuilder/stable.h>

#include <cstdint>
#include <tuple>

#include "relu_cpu.h"
#include "relu_mask.h"
#ifdef OPB_WITH_CUDA
#include "relu.cuh"
#endif

namespace {

namespace relu = opb::relu;
using opb::Tensor;
using opb::ScalarType;

constexpr const char* kOp = "relu";
constexpr const char* kMask = "relu_mask";
constexpr const char* kBwd = "relu_mask_backward";

Tensor prepare(const char* op, const Tensor& x) {
  opb::dtype_of(x, op, "x");
  return opb::contiguous(x);
}

Tensor new_mask(const Tensor& x) {
  return opb::new_tensor(x, {relu::mask_words(x.numel(), x.element_size())}, ScalarType::Int);
}

struct BwdInputs {
  Tensor dy, mask;
};

// The mask must be what relu_mask made for a tensor of grad_y's size and dtype.
BwdInputs prepare_backward(const Tensor& grad_y, const Tensor& mask) {
  opb::dtype_of(grad_y, kBwd, "grad_y");
  STD_TORCH_CHECK(mask.scalar_type() == ScalarType::Int, kBwd, ": mask must be int32 (from relu_mask), got ",
                  mask.scalar_type());
  STD_TORCH_CHECK(opb::same_device(mask, grad_y), kBwd, ": mask must be on grad_y's device ",
                  opb::device_str(grad_y), ", got ", opb::device_str(mask));
  const int64_t words = relu::mask_words(grad_y.numel(), grad_y.element_size());
  STD_TORCH_CHECK(mask.dim() == 1 && mask.size(0) == words, kBwd, ": mask must have shape [", words, "] for ",
                  grad_y.numel(), " ", grad_y.scalar_type(), " elements, got ", opb::shape_str(mask.sizes()));
  Tensor m = opb::contiguous(mask);
  // The GPU reads a tile's words with 16-byte loads.
  if (reinterpret_cast<uintptr_t>(m.const_data_ptr()) % 16 != 0) m = torch::stable::clone(m);
  return {opb::contiguous(grad_y), m};
}

Tensor relu_cpu(Tensor x) {
  Tensor xc = prepare(kOp, x);
  Tensor y = opb::new_output(xc);
  relu::relu_cpu(xc.const_data_ptr(), y.mutable_data_ptr(), xc.numel(), opb::dtype_of(xc, kOp, "x"));
  return y;
}

std::tuple<Tensor, Tensor> relu_mask_cpu(Tensor x) {
  Tensor xc = prepare(kMask, x);
  Tensor y = opb::new_output(xc);
  Tensor mask = new_mask(xc);
  relu::relu_mask_cpu(xc.const_data_ptr(), y.mutable_data_ptr(), mask.mutable_data_ptr(), xc.numel(),
                      opb::dtype_of(xc, kMask, "x"));
  return {y, mask};
}

Tensor relu_mask_backward_cpu(Tensor grad_y, Tensor mask) {
  BwdInputs in = prepare_backward(grad_y, mask);
  Tensor dx = opb::new_output(in.dy);
  relu::relu_mask_backward_cpu(in.dy.const_data_ptr(), in.mask.const_data_ptr(), dx.mutable_data_ptr(),
                               in.dy.numel(), opb::dtype_of(in.dy, kBwd, "grad_y"));
  return dx;
}

#ifdef OPB_WITH_CUDA
Tensor relu_cuda(Tensor x) {
  Tensor xc = prepare(kOp, x);
  const auto guard = opb::device_guard(xc);
  Tensor y = opb::new_output(xc);
  opb::check_launch(relu::launch(xc.const_data_ptr(), y.mutable_data_ptr(), xc.numel(), opb::dtype_of(xc, kOp, "x"),
                                 opb::stream_of(xc)),
                    kOp);
  return y;
}

std::tuple<Tensor, Tensor> relu_mask_cuda(Tensor x) {
  Tensor xc = prepare(kMask, x);
  const auto guard = opb::device_guard(xc);
  Tensor y = opb::new_output(xc);
  Tensor mask = new_mask(xc);
  opb::check_launch(relu::launch_mask(xc.const_data_ptr(), y.mutable_data_ptr(), mask.mutable_data_ptr(), xc.numel(),
                                      opb::dtype_of(xc, kMask, "x"), opb::stream_of(xc)),
                    kMask);
  return {y, mask};
}

Tensor relu_mask_backward_cuda(Tensor grad_y, Tensor mask) {
  BwdInputs in = prepare_backward(grad_y, mask);
  const auto guard = opb::device_guard(in.dy);
  Tensor dx = opb::new_output(in.dy);
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
  m.def("relu.nograd(Tensor x) -> Tensor");
  m.def("relu_mask(Tensor x) -> (Tensor, Tensor)");
  m.def("relu_mask.nograd(Tensor x) -> (Tensor, Tensor)");
  m.def("relu_mask_backward(Tensor grad_y, Tensor mask) -> Tensor");
}

OPB_LIBRARY_IMPL(CPU, m) {
  m.impl("relu", TORCH_BOX(&relu_cpu));
  m.impl("relu.nograd", TORCH_BOX(&relu_cpu));
  m.impl("relu_mask", TORCH_BOX(&relu_mask_cpu));
  m.impl("relu_mask.nograd", TORCH_BOX(&relu_mask_cpu));
  m.impl("relu_mask_backward", TORCH_BOX(&relu_mask_backward_cpu));
}

#ifdef OPB_WITH_CUDA
OPB_LIBRARY_IMPL(CUDA, m) {
  m.impl("relu", TORCH_BOX(&relu_cuda));
  m.impl("relu.nograd", TORCH_BOX(&relu_cuda));
  m.impl("relu_mask", TORCH_BOX(&relu_mask_cuda));
  m.impl("relu_mask.nograd", TORCH_BOX(&relu_mask_cuda));
  m.impl("relu_mask_backward", TORCH_BOX(&relu_mask_backward_cuda));
}
#endif
