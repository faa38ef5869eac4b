// fused_add_rmsnorm backward launcher: grad_h and per-block weight-gradient sums in one pass when the
// row fits in registers, else per-row statistics then a tiled pass; then the sum over blocks.
#include "fused_add_rmsnorm.cuh"
#include "fused_add_rmsnorm_kernel.cuh"
#include "fused_add_rmsnorm_plan.cuh"
#include "common/multiprocessors.h"

#include <climits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

namespace opb::fused_add_rmsnorm {
namespace {

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Resident blocks per SM of a kernel at this block size, asked once per (device, kernel, block size).
int blocks_per_sm(const void* kernel, int threads, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  int dev = 0;
  cudaGetDevice(&dev);
  const auto key = std::make_tuple(dev, kernel, threads, smem);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) {
    cudaGetLastError();  // a failed query is not the launch's error
    n = 1;
  }
  cache.emplace(key, n);
  return n;
}

// Up to 2 packs a thread and 512 threads a row: 8192 bf16/fp16 or 4096 fp32 elements in registers
// (at most 64 registers a thread, so that 1024 threads fit on an SM).
constexpr int kMaxNv = 2;
constexpr int kMaxTpr = 512;
constexpr int kShortThreads = 128;
constexpr int kTileThreads = 256;

template <typename T>
const void* rows_kernel(int nv) {
  switch (nv) {
    case 1: return reinterpret_cast<const void*>(&backward_rows_kernel<T, 1>);
    default: return reinterpret_cast<const void*>(&backward_rows_kernel<T, 2>);
  }
}

struct Plan {
  bool rows_path = false;
  plan::Rows rp;
  int64_t grid = 0;  // rows path: blocks
  size_t smem = 0;   // rows path: dynamic shared memory
  int n = 1;         // loop path: elements per load
  int64_t col_blocks = 0, chunks = 0, rows_per_chunk = 0;
  int64_t parts = 0;  // rows of weight-gradient partial sums
  int64_t workspace(int64_t rows, int64_t hidden) const { return parts * hidden + (rows_path ? 0 : 2 * rows); }
};

template <typename T>
Plan make_plan(int64_t rows, int64_t hidden) {
  constexpr int P = kPack<T>;
  Plan p;
  const int sms = opb::multiprocessors();
  if constexpr (!std::is_same_v<T, double>) {
    p.rp = plan::rows_plan(hidden / P, kMaxNv, kMaxTpr, kShortThreads);
    if (hidden % P == 0 && p.rp.ok) {
      const int rpb = p.rp.rows_per_block();
      p.rows_path = true;
      p.smem = size_t(rpb) * size_t(hidden) * sizeof(float);  // <= 32 KiB: no opt-in needed
      const int occ = blocks_per_sm(rows_kernel<T>(p.rp.nv), p.rp.threads, p.smem);
      const int64_t resident = int64_t(sms) * occ;
      const int64_t needed = plan::ceil_div(rows, rpb);
      p.grid = needed < resident ? needed : resident;
      p.parts = p.grid;
      return p;
    }
  }
  p.n = hidden % P == 0 ? P : 1;
  const int64_t units = hidden / p.n;
  p.col_blocks = plan::ceil_div(units, kTileThreads);
  // About 8 blocks of 256 threads per SM in all; each chunk of rows adds a row of partial sums.
  const int64_t target = int64_t(sms) * 8;
  int64_t chunks = plan::ceil_div(target, p.col_blocks);
  chunks = chunks < rows ? chunks : rows;
  p.rows_per_chunk = plan::ceil_div(rows, chunks);
  p.chunks = plan::ceil_div(rows, p.rows_per_chunk);
  p.parts = p.chunks;
  return p;
}

template <typename T>
cudaError_t backward_typed(const T* grad_out, const T* grad_res, const T* h, const T* weight, T* grad_h,
                           T* grad_h2, T* grad_weight, acc_t<T>* workspace, int64_t workspace_size, int64_t rows,
                           int64_t hidden, double eps, cudaStream_t stream) {
  using A = acc_t<T>;
  const Plan p = make_plan<T>(rows, hidden);
  if (p.workspace(rows, hidden) != workspace_size) return cudaErrorInvalidValue;
  A* partial = workspace;
  if (p.rows_path) {
    if constexpr (!std::is_same_v<T, double>) {
      const int nvec = static_cast<int>(hidden / kPack<T>);
      const float inv_hidden = 1.f / static_cast<float>(hidden);
      const float feps = static_cast<float>(eps);
#define OPB_BWD_ROWS(NV)                                                                                     \
  backward_rows_kernel<T, NV><<<static_cast<unsigned>(p.grid), p.rp.threads, p.smem, stream>>>(              \
      grad_out, grad_res, h, weight, grad_h, grad_h2, partial, rows, nvec, p.rp.tpr, inv_hidden, feps)
      switch (p.rp.nv) {
        case 1: OPB_BWD_ROWS(1); break;
        default: OPB_BWD_ROWS(2); break;
      }
#undef OPB_BWD_ROWS
    }
  } else {
    if (rows > INT_MAX || p.col_blocks > INT_MAX || p.chunks > 65535) return cudaErrorInvalidConfiguration;
    A* stats = workspace + p.parts * hidden;
    const A inv_hidden = A(1) / static_cast<A>(hidden);
    const dim3 tiles(static_cast<unsigned>(p.col_blocks), static_cast<unsigned>(p.chunks));
    if (p.n == kPack<T>) {
      constexpr int N = kPack<T>;
      backward_stats_kernel<T, N><<<static_cast<unsigned>(rows), plan::loop_threads(hidden / N), 0, stream>>>(
          grad_out, h, weight, stats, hidden, inv_hidden, static_cast<A>(eps));
      backward_tile_kernel<T, N><<<tiles, kTileThreads, 0, stream>>>(grad_out, grad_res, h, weight, stats, grad_h,
                                                                     grad_h2, partial, rows, hidden, p.rows_per_chunk);
    } else {
      backward_stats_kernel<T, 1><<<static_cast<unsigned>(rows), plan::loop_threads(hidden), 0, stream>>>(
          grad_out, h, weight, stats, hidden, inv_hidden, static_cast<A>(eps));
      backward_tile_kernel<T, 1><<<tiles, kTileThreads, 0, stream>>>(grad_out, grad_res, h, weight, stats, grad_h,
                                                                     grad_h2, partial, rows, hidden, p.rows_per_chunk);
    }
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  weight_grad_kernel<T><<<static_cast<unsigned>(plan::ceil_div(hidden, 32)), dim3(32, 32), 0, stream>>>(
      partial, grad_weight, p.parts, hidden);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_cast(const void* grad_out, const void* grad_res, const void* h, const void* weight, void* grad_h,
                          void* grad_h2, void* grad_weight, void* workspace, int64_t workspace_size, int64_t rows,
                          int64_t hidden, double eps, cudaStream_t stream) {
  return backward_typed(static_cast<const T*>(grad_out), static_cast<const T*>(grad_res), static_cast<const T*>(h),
                        static_cast<const T*>(weight), static_cast<T*>(grad_h), static_cast<T*>(grad_h2),
                        static_cast<T*>(grad_weight), static_cast<acc_t<T>*>(workspace), workspace_size, rows, hidden,
                        eps, stream);
}

}  // namespace

int64_t backward_workspace_size(int64_t rows, int64_t hidden, DType dtype) {
  if (rows <= 0 || hidden <= 0) return 0;
  switch (dtype) {
    case DType::Float32: return make_plan<float>(rows, hidden).workspace(rows, hidden);
    case DType::Float16: return make_plan<__half>(rows, hidden).workspace(rows, hidden);
    case DType::BFloat16: return make_plan<__nv_bfloat16>(rows, hidden).workspace(rows, hidden);
    case DType::Float64: return make_plan<double>(rows, hidden).workspace(rows, hidden);
  }
  return 0;
}

cudaError_t launch_backward(const void* grad_out, const void* grad_residual_out, const void* h, const void* weight,
                            void* grad_h, void* grad_h2, void* grad_weight, void* workspace, int64_t workspace_size,
                            int64_t rows, int64_t hidden, double eps, DType dtype, cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  if (!aligned16(grad_out) || !aligned16(h) || !aligned16(weight) || !aligned16(grad_h) ||
      !aligned16(grad_weight) || !aligned16(workspace) ||
      (grad_residual_out != nullptr && !aligned16(grad_residual_out)) || (grad_h2 != nullptr && !aligned16(grad_h2))) {
    return cudaErrorMisalignedAddress;
  }
  switch (dtype) {
#define OPB_CASE(D, T)                                                                                       \
  case DType::D:                                                                                             \
    return backward_cast<T>(grad_out, grad_residual_out, h, weight, grad_h, grad_h2, grad_weight, workspace, \
                            workspace_size, rows, hidden, eps, stream);
    OPB_CASE(Float32, float)
    OPB_CASE(Float16, __half)
    OPB_CASE(BFloat16, __nv_bfloat16)
    OPB_CASE(Float64, double)
#undef OPB_CASE
  }
  return cudaErrorInvalidValue;
}

}  // namespace opb::fused_add_rmsnorm
