// softmax backward: the element type's launcher (each in its own softmax_backward_<type>.cu).
#include "softmax_launch.cuh"
#include "softmax_typed.cuh"

namespace opb::softmax {

cudaError_t backward(const Problem& p, const Plan& plan, const void* y, const void* grad_y, void* grad_x,
                     void* workspace, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  if (plan_error(plan, p) != nullptr) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::Float32: return backward_vec<float>(p, plan, y, grad_y, grad_x, workspace, stream);
    case DType::Float16: return backward_vec<__half>(p, plan, y, grad_y, grad_x, workspace, stream);
    case DType::BFloat16: return backward_vec<__nv_bfloat16>(p, plan, y, grad_y, grad_x, workspace, stream);
    case DType::Float64: return backward_vec<double>(p, plan, y, grad_y, grad_x, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace opb::softmax
