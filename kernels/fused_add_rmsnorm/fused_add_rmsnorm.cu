// fused_add_rmsnorm forward launcher: the row-in-registers kernel when the row fits, else the loop kernel.
#include "fused_add_rmsnorm.cuh"
#include "fused_add_rmsnorm_kernel.cuh"
#include "fused_add_rmsnorm_plan.cuh"

#include <climits>
#include <type_traits>

namespace opb::fused_add_rmsnorm {
namespace {

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
cudaError_t forward_typed(const T* input, const T* residual, const T* weight, T* out, T* residual_out, int64_t rows,
                          int64_t hidden, double eps, cudaStream_t stream) {
  constexpr int P = kPack<T>;
  if constexpr (!std::is_same_v<T, double>) {
    // Up to 8 packs a thread and 512 threads a row: 32768 bf16/fp16 or 16384 fp32 elements.
    const plan::Rows rp = plan::rows_plan(hidden / P, 8, 512, 256);
    if (hidden % P == 0 && rp.ok) {
      const int64_t blocks = plan::ceil_div(rows, rp.rows_per_block());
      if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
      const int nvec = static_cast<int>(hidden / P);
      const float inv_hidden = 1.f / static_cast<float>(hidden);
      const float feps = static_cast<float>(eps);
      if (nvec == 512) {
        // 512 packs (bf16/fp16 hidden 4096, fp32 2048): one pack a thread x 512 threads, the weight loaded
        // with the row, plain loads. Measured on an H200 (benchmarks/NOTES.md, bf16 hidden 4096) against
        // the plan's 4 packs x 128 threads, weight after the reduction, __ldcs: 32768 rows 272.7 -> 262.8 us,
        // 4096 rows 38.8 -> 37.7 us, 128 rows 7.3 -> 6.1 us. Other sizes keep the plan until measured.
        // 512 threads as a compile-time constant: on an H100 (benchmarks/quick_rmsnorm.py), 128 rows
        // 6.05 -> 5.76 us; 4096 and 32768 rows unchanged (49.44 -> 49.47, 357.79 -> 358.27 us).
        forward_rows_kernel<T, 1, true, false, 512><<<static_cast<unsigned>(rows), 512, 0, stream>>>(
            input, residual, weight, out, residual_out, rows, nvec, 512, inv_hidden, feps);
        return cudaGetLastError();
      }
#define OPB_FWD_ROWS(NV)                                                                                        \
  forward_rows_kernel<T, NV, false, true><<<static_cast<unsigned>(blocks), rp.threads, 0, stream>>>(            \
      input, residual, weight, out, residual_out, rows, nvec, rp.tpr, inv_hidden, feps)
      switch (rp.nv) {
        case 1: OPB_FWD_ROWS(1); break;
        case 2: OPB_FWD_ROWS(2); break;
        case 4: OPB_FWD_ROWS(4); break;
        default: OPB_FWD_ROWS(8); break;
      }
#undef OPB_FWD_ROWS
      return cudaGetLastError();
    }
  }
  if (rows > INT_MAX) return cudaErrorInvalidConfiguration;
  using A = acc_t<T>;
  const A inv_hidden = A(1) / static_cast<A>(hidden);
  if (hidden % P == 0) {
    forward_loop_kernel<T, P><<<static_cast<unsigned>(rows), plan::loop_threads(hidden / P), 0, stream>>>(
        input, residual, weight, out, residual_out, hidden, inv_hidden, static_cast<A>(eps));
  } else {
    forward_loop_kernel<T, 1><<<static_cast<unsigned>(rows), plan::loop_threads(hidden), 0, stream>>>(
        input, residual, weight, out, residual_out, hidden, inv_hidden, static_cast<A>(eps));
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t forward_cast(const void* input, const void* residual, const void* weight, void* out, void* residual_out,
                         int64_t rows, int64_t hidden, double eps, cudaStream_t stream) {
  return forward_typed(static_cast<const T*>(input), static_cast<const T*>(residual), static_cast<const T*>(weight),
                       static_cast<T*>(out), static_cast<T*>(residual_out), rows, hidden, eps, stream);
}

}  // namespace

cudaError_t launch_forward(const void* input, const void* residual, const void* weight, void* out,
                           void* residual_out, int64_t rows, int64_t hidden, double eps, DType dtype,
                           cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  if (!aligned16(input) || !aligned16(weight) || !aligned16(out) ||
      (residual != nullptr && (!aligned16(residual) || !aligned16(residual_out)))) {
    return cudaErrorMisalignedAddress;
  }
  switch (dtype) {
    case DType::Float32:
      return forward_cast<float>(input, residual, weight, out, residual_out, rows, hidden, eps, stream);
    case DType::Float16:
      return forward_cast<__half>(input, residual, weight, out, residual_out, rows, hidden, eps, stream);
    case DType::BFloat16:
      return forward_cast<__nv_bfloat16>(input, residual, weight, out, residual_out, rows, hidden, eps, stream);
    case DType::Float64:
      return forward_cast<double>(input, residual, weight, out, residual_out, rows, hidden, eps, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace opb::fused_add_rmsnorm
