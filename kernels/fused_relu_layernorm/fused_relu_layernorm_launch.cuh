// Launch configuration of fused_relu_layernorm from the shape, for one element type. Included by the
// per-dtype .cu files (so the instantiations compile in parallel), never by the binding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/multiprocessors.h"
#include "fused_relu_layernorm_kernel.cuh"
#include "fused_relu_layernorm_typed.cuh"

namespace opb::fused_relu_layernorm {

inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Elements per 16-byte pack.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

// ---- forward --------------------------------------------------------------------------------------

// ROWS, for a warp a row: 2 at 3 packs (bf16 768: 9.6 us; with 1, 4, 8 rows 10.1, 10.3, 9.8), else 4
// (not measured with this kernel). EVEN: hidden == NV * TPR * VEC (every thread holds NV full packs;
// the merge needs no counts). W_EARLY: the weight and bias are loaded with x (see the kernel).
// H100, benchmarks/quick_layernorm.py (benchmarks/NOTES.md).
template <typename T, int VEC, int NV, int TPR, bool W_EARLY, bool EVEN = false>
cudaError_t fwd_reg(const FwdArgs& a, cudaStream_t stream) {
  constexpr int ROWS = TPR == 32 ? (NV == 3 ? 2 : 4) : 1;
  const int64_t blocks = (a.rows + ROWS - 1) / ROWS;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  fwd_reg_kernel<T, VEC, NV, TPR, ROWS, W_EARLY, EVEN><<<static_cast<unsigned>(blocks), TPR * ROWS, 0, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.w), static_cast<const T*>(a.b), static_cast<T*>(a.y),
      static_cast<float*>(a.mean), static_cast<float*>(a.rstd), a.rows, static_cast<int>(a.hidden),
      static_cast<float>(a.eps));
  return cudaGetLastError();
}

// Threads for the *_any kernels: enough to cover a row once, 32..512.
inline int any_threads(int64_t nvec) {
  int64_t t = std::min<int64_t>(512, std::max<int64_t>(32, nvec));
  return static_cast<int>((t + 31) / 32 * 32);
}

template <typename T, int VEC>
cudaError_t fwd_any(const FwdArgs& a, cudaStream_t stream) {
  using A = acc_t<T>;
  const int threads = any_threads((a.hidden + VEC - 1) / VEC);
  const int64_t blocks = std::min<int64_t>(a.rows, int64_t(opb::multiprocessors()) * (2048 / threads) * 4);
  fwd_any_kernel<T, A, VEC><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.w), static_cast<const T*>(a.b), static_cast<T*>(a.y),
      static_cast<A*>(a.mean), static_cast<A*>(a.rstd), a.rows, a.hidden, static_cast<A>(a.eps));
  return cudaGetLastError();
}

// Rows that fill every thread's packs exactly (the usual model widths, on the 16-byte path) merge
// without counts, which makes 2 or 3 packs a thread over more threads pay: bf16, against 4 packs a
// thread with counts, 1024 wide 64 x 2 3% faster, 2048 128 x 2 2%, 3072 128 x 3 3%, 4096 256 x 2 1% (3% at
// 4096 rows), 8192 256 x 4 1%; 512 x 1 at 4096 was 15% slower. The weight and bias early where it
// measured faster: a warp a row (the rows are short and the grid one wave), and 128 x 3 (1.4%); at
// 256 x 2 they cost 5% (fewer CTAs an SM), at 512 x 2 17%. 768 packs and 1536 are not measured.
// Other rows: the smallest row group that holds the row in registers (at most 32 floats of data per
// thread), else the streaming kernel.
template <typename T, int VEC>
cudaError_t fwd_dispatch(const FwdArgs& a, cudaStream_t stream) {
  const int64_t nvec = (a.hidden + VEC - 1) / VEC;
  if constexpr (VEC > 1) {
    switch (nvec) {  // the 16-byte path has hidden == nvec * VEC
      case 32: return fwd_reg<T, VEC, 1, 32, true, true>(a, stream);
      case 64: return fwd_reg<T, VEC, 2, 32, true, true>(a, stream);
      case 96: return fwd_reg<T, VEC, 3, 32, true, true>(a, stream);
      case 128: return fwd_reg<T, VEC, 2, 64, false, true>(a, stream);
      case 192: return fwd_reg<T, VEC, 3, 64, true, true>(a, stream);
      case 256: return fwd_reg<T, VEC, 2, 128, false, true>(a, stream);
      case 384: return fwd_reg<T, VEC, 3, 128, true, true>(a, stream);
      case 512: return fwd_reg<T, VEC, 2, 256, false, true>(a, stream);
      case 768: return fwd_reg<T, VEC, 3, 256, false, true>(a, stream);
      case 1024: return fwd_reg<T, VEC, 4, 256, false, true>(a, stream);
      case 1536: return fwd_reg<T, VEC, 3, 512, false, true>(a, stream);
      case 2048: return fwd_reg<T, VEC, 4, 512, false, true>(a, stream);
      default: break;
    }
  }
  // W_EARLY at 3 packs a lane or fewer (bf16 768 a warp a row: 10.3 us early, 11.2 late); at 4 packs the
  // weight and bias beside x take 64-71 registers instead of 40.
  if (nvec <= 32) return fwd_reg<T, VEC, 1, 32, true>(a, stream);
  if (nvec <= 64) return fwd_reg<T, VEC, 2, 32, true>(a, stream);
  if (nvec <= 96) return fwd_reg<T, VEC, 3, 32, true>(a, stream);
  if (nvec <= 128) return fwd_reg<T, VEC, 4, 32, false>(a, stream);
  if (nvec <= 256) return fwd_reg<T, VEC, 4, 64, false>(a, stream);
  if (nvec <= 512) return fwd_reg<T, VEC, 4, 128, false>(a, stream);
  if (nvec <= 1024) return fwd_reg<T, VEC, 4, 256, false>(a, stream);
  if (nvec <= 2048) return fwd_reg<T, VEC, 4, 512, false>(a, stream);
  return fwd_any<T, VEC>(a, stream);
}

template <typename T>
cudaError_t forward_typed(const FwdArgs& a, cudaStream_t stream) {
  constexpr int V = kVec<T>;
  const bool vec = a.hidden % V == 0 && aligned16(a.x) && aligned16(a.y) && aligned16(a.w) && aligned16(a.b);
  if constexpr (std::is_same_v<T, double>) {
    return vec ? fwd_any<T, V>(a, stream) : fwd_any<T, 1>(a, stream);
  } else {
    return vec ? fwd_dispatch<T, V>(a, stream) : fwd_dispatch<T, 1>(a, stream);
  }
}

// ---- backward -------------------------------------------------------------------------------------

template <typename T, typename A>
cudaError_t reduce_partials(const BwdArgs& a, int64_t n_part, cudaStream_t stream) {
  const A* pw = static_cast<const A*>(a.workspace);
  const A* pb = pw + n_part * a.hidden;
  const int64_t blocks = (a.hidden + 31) / 32;
  reduce_partials_kernel<T, A><<<static_cast<unsigned>(blocks), dim3(32, 16), 0, stream>>>(
      pw, pb, n_part, a.hidden, static_cast<T*>(a.dw), static_cast<T*>(a.db));
  return cudaGetLastError();
}

template <typename T, int VEC, int NV, int TPR>
BwdPlan bwd_reg(const BwdArgs& a, cudaStream_t stream, bool launch) {
  constexpr int ROWS = TPR == 32 ? 8 : 1;  // 256-thread CTAs for a warp per row
  constexpr int kThreads = TPR * ROWS;
  auto kernel = bwd_reg_kernel<T, VEC, NV, TPR, ROWS>;
  // Persistent CTAs: as many as fit at once, so each walks many rows and writes one partial row.
  static const int per_sm = [&] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0) != cudaSuccess || n < 1) n = 1;
    return n;
  }();
  const int64_t groups = (a.rows + ROWS - 1) / ROWS;
  const int64_t grid = std::min<int64_t>(groups, int64_t(opb::multiprocessors()) * per_sm);
  BwdPlan plan{a.dw != nullptr ? grid : 0, cudaSuccess};
  if (!launch) return plan;
  float* pw = static_cast<float*>(a.workspace);
  kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const T*>(a.dy), static_cast<const T*>(a.x), static_cast<const T*>(a.w),
      static_cast<const float*>(a.mean), static_cast<const float*>(a.rstd), static_cast<T*>(a.dx),
      a.dw != nullptr ? pw : nullptr, a.dw != nullptr ? pw + grid * a.hidden : nullptr, a.rows,
      static_cast<int>(a.hidden));
  plan.err = cudaGetLastError();
  if (plan.err == cudaSuccess && a.dw != nullptr) plan.err = reduce_partials<T, float>(a, grid, stream);
  return plan;
}

template <typename T, int VEC>
BwdPlan bwd_any(const BwdArgs& a, cudaStream_t stream, bool launch) {
  using A = acc_t<T>;
  const int64_t col_blocks = (a.hidden + 31) / 32;
  // Enough (column block, row chunk) CTAs to fill the GPU a few times over.
  int64_t chunks = std::max<int64_t>(1, (int64_t(opb::multiprocessors()) * 8 + col_blocks - 1) / col_blocks);
  chunks = std::min<int64_t>({chunks, a.rows, 65535});
  const int64_t rows_per_chunk = (a.rows + chunks - 1) / chunks;
  chunks = (a.rows + rows_per_chunk - 1) / rows_per_chunk;
  BwdPlan plan{a.dw != nullptr ? chunks : 0, cudaSuccess};
  if (!launch) return plan;
  const int threads = any_threads((a.hidden + VEC - 1) / VEC);
  const int64_t blocks = std::min<int64_t>(a.rows, int64_t(opb::multiprocessors()) * (2048 / threads) * 4);
  bwd_any_kernel<T, A, VEC><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      static_cast<const T*>(a.dy), static_cast<const T*>(a.x), static_cast<const T*>(a.w),
      static_cast<const A*>(a.mean), static_cast<const A*>(a.rstd), static_cast<T*>(a.dx), a.rows, a.hidden);
  plan.err = cudaGetLastError();
  if (plan.err != cudaSuccess || a.dw == nullptr) return plan;
  A* pw = static_cast<A*>(a.workspace);
  dwdb_any_kernel<T, A><<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks)), dim3(32, 8), 0,
                          stream>>>(static_cast<const T*>(a.dy), static_cast<const T*>(a.x),
                                    static_cast<const A*>(a.mean), static_cast<const A*>(a.rstd), pw,
                                    pw + chunks * a.hidden, a.rows, a.hidden, rows_per_chunk);
  plan.err = cudaGetLastError();
  if (plan.err == cudaSuccess) plan.err = reduce_partials<T, A>(a, chunks, stream);
  return plan;
}

// As the forward, with at most 2 packs per thread on the 16-byte path (the dw/db sums, the prefetched
// next row and the weight all live in registers too); 3 packs for a warp per row (768 x 16-bit).
template <typename T, int VEC>
BwdPlan bwd_dispatch(const BwdArgs& a, cudaStream_t stream, bool launch) {
  constexpr int NVM = VEC > 1 ? 2 : 4;
  const int64_t nvec = (a.hidden + VEC - 1) / VEC;
  if (nvec <= 32) return bwd_reg<T, VEC, 1, 32>(a, stream, launch);
  if (nvec <= 64) return bwd_reg<T, VEC, 2, 32>(a, stream, launch);
  if (nvec <= 96) return bwd_reg<T, VEC, 3, 32>(a, stream, launch);
  if (nvec <= 64 * NVM) return bwd_reg<T, VEC, NVM, 64>(a, stream, launch);
  if (nvec <= 128 * NVM) return bwd_reg<T, VEC, NVM, 128>(a, stream, launch);
  if (nvec <= 256 * NVM) return bwd_reg<T, VEC, NVM, 256>(a, stream, launch);
  if (nvec <= 512 * NVM) return bwd_reg<T, VEC, NVM, 512>(a, stream, launch);
  return bwd_any<T, VEC>(a, stream, launch);
}

template <typename T>
BwdPlan backward_typed(const BwdArgs& a, cudaStream_t stream, bool launch) {
  constexpr int V = kVec<T>;
  const bool vec = a.hidden % V == 0 && aligned16(a.dy) && aligned16(a.x) && aligned16(a.dx) && aligned16(a.w);
  if constexpr (std::is_same_v<T, double>) {
    return vec ? bwd_any<T, V>(a, stream, launch) : bwd_any<T, 1>(a, stream, launch);
  } else {
    return vec ? bwd_dispatch<T, V>(a, stream, launch) : bwd_dispatch<T, 1>(a, stream, launch);
  }
}

}  // namespace opb::fused_relu_layernorm

// One line per element type and direction, in its own .cu file (fused_relu_layernorm_<type>.cu for the
// forward, fused_relu_layernorm_<type>_backward.cu): nvcc compiles them in parallel.
#define OPB_FRLN_FORWARD(T)                                                          \
  namespace opb::fused_relu_layernorm {                                             \
  template cudaError_t forward_typed<T>(const FwdArgs&, cudaStream_t);              \
  }
#define OPB_FRLN_BACKWARD(T)                                                         \
  namespace opb::fused_relu_layernorm {                                             \
  template BwdPlan backward_typed<T>(const BwdArgs&, cudaStream_t, bool launch);    \
  }
