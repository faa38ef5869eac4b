// fused_relu_layernorm's launchers: the element type picks one of the per-type entry points.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fused_relu_layernorm.cuh"
#include "fused_relu_layernorm_typed.cuh"

namespace opb::fused_relu_layernorm {
namespace {

BwdPlan backward_plan(const BwdArgs& args, cudaStream_t stream, bool launch) {
  switch (args.dtype) {
    case DType::Float32: return backward_typed<float>(args, stream, launch);
    case DType::Float16: return backward_typed<__half>(args, stream, launch);
    case DType::BFloat16: return backward_typed<__nv_bfloat16>(args, stream, launch);
    case DType::Float64: return backward_typed<double>(args, stream, launch);
  }
  return {0, cudaErrorInvalidValue};
}

}  // namespace

cudaError_t launch_forward(const FwdArgs& args, cudaStream_t stream) {
  if (args.rows == 0 || args.hidden == 0) return cudaSuccess;
  switch (args.dtype) {
    case DType::Float32: return forward_typed<float>(args, stream);
    case DType::Float16: return forward_typed<__half>(args, stream);
    case DType::BFloat16: return forward_typed<__nv_bfloat16>(args, stream);
    case DType::Float64: return forward_typed<double>(args, stream);
  }
  return cudaErrorInvalidValue;
}

int64_t backward_workspace_elems(const BwdArgs& args) {
  if (args.rows == 0 || args.hidden == 0 || args.dw == nullptr) return 0;
  return 2 * backward_plan(args, nullptr, false).n_part * args.hidden;
}

cudaError_t launch_backward(const BwdArgs& args, cudaStream_t stream) {
  if (args.rows == 0 || args.hidden == 0) return cudaSuccess;
  return backward_plan(args, stream, true).err;
}

}  // namespace opb::fused_relu_layernorm
