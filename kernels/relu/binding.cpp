// relu as a Torch op: schema, input checks, CPU and CUDA implementations.
#include <opbuilder/binding.h>

#include "relu_cpu.h"
#ifdef OPB_WITH_CUDA
#include "relu.cuh"
#endif

namespace {

constexpr const char* kOp = "relu";

at::Tensor prepare(const at::Tensor& x) {
  opb::dtype_of(x, kOp, "x");
  return x.contiguous();
}

at::Tensor relu_cpu(const at::Tensor& x) {
  at::Tensor xc = prepare(x);
  at::Tensor y = opb::new_output(xc);
  opb::relu::relu_cpu(xc.const_data_ptr(), y.mutable_data_ptr(), xc.numel(), opb::dtype_of(xc, kOp, "x"));
  return y;
}

#ifdef OPB_WITH_CUDA
at::Tensor relu_cuda(const at::Tensor& x) {
  at::Tensor xc = prepare(x);
  c10::cuda::CUDAGuard guard(xc.device());
  at::Tensor y = opb::new_output(xc);
  opb::check_launch(opb::relu::launch(xc.const_data_ptr(), y.mutable_data_ptr(), xc.numel(),
                                      opb::dtype_of(xc, kOp, "x"), opb::stream_of(xc)),
                    kOp);
  return y;
}
#endif

}  // namespace

OPB_LIBRARY(m) { m.def("relu(Tensor x) -> Tensor"); }

OPB_LIBRARY_IMPL(CPU, m) { m.impl("relu", &relu_cpu); }

#ifdef OPB_WITH_CUDA
OPB_LIBRARY_IMPL(CUDA, m) { m.impl("relu", &relu_cuda); }
#endif
