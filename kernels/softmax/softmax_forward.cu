// softmax forward: the element type's launcher (each in its own softmax_forward_<type>.cu).
#include "softmax_launch.cuh"
#include "softmax_typed.cuh"

namespace opb::softmax {

cudaError_t forward(const Problem& p, const Plan& plan, const void* x, void* y, void* workspace,
                    cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  if (plan_error(plan, p) != nullptr) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::Float32: return forward_vec<float>(p, plan, x, y, workspace, stream);
    case DType::Float16: return forward_vec<__half>(p, plan, x, y, workspace, stream);
    case DType::BFloat16: return forward_vec<__nv_bfloat16>(p, plan, x, y, workspace, stream);
    case DType::Float64: return forward_vec<double>(p, plan, x, y, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace opb::softmax
