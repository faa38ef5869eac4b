// The ReLU and bias part of fused_matmul_add_relu's backward, in one pass over the gradient:
//   grad_pre[r, c]  = out[r, c] <= 0 ? 0 : grad[r, c]      (threshold_backward(grad, out, 0): NaN passes)
//   grad_bias[c]    = sum over r of grad_pre[r, c]          (fp32 accumulation; fp64 for double)
// What ATen does in two passes (threshold_backward, then sum over dim 0 re-reading grad_pre).
//
// Kernel 1: a block is 32 x 8 threads over 32 column packs (16 bytes each, or one element) and a chunk
// of rows; each thread walks the chunk's rows 8 apart (four rows' loads issued before their use), writes grad_pre and sums its columns; the block's 8
// partial sums per column are added in shared memory, in order, and stored to a [chunks, cols]
// workspace (or, with one chunk, rounded into grad_bias). Kernel 2 adds the chunks per column in order:
// the result is the same from run to run. (Which plan runs, 16-byte packs or single elements, depends on
// the pointers' alignment, and so may the bias's last bit: the two plans cut the rows into different chunks.)
#include "fused_matmul_add_relu.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstring>
#include <type_traits>

#include "common/cuda_types.cuh"
#include "common/multiprocessors.h"

namespace opb::fused_matmul_add_relu {
namespace {

constexpr int kColThreads = 32;
constexpr int kRowThreads = 8;

template <typename T, int P>
struct alignas(sizeof(T) * P) Pack {
  T v[P];
};

template <typename T>
constexpr int kPackOf = 16 / static_cast<int>(sizeof(T));

struct Plan {
  int64_t col_blocks;
  int64_t chunks;
  int64_t rows_per_chunk;
};

// Enough blocks to fill every SM's threads (8 blocks of 256), as long as each thread still walks at least
// kMinRowsPerThread rows and there are at most kMaxChunks chunks: kernel 2 adds a column's chunks one after
// another (512 chunks made 16384 x 128 bf16 take 109 us against ATen's 30 on an H100).
constexpr int kBlocksPerSM = 8;
constexpr int kMinRowsPerThread = 4;
constexpr int64_t kMaxChunks = 64;
// Rows a thread loads before it uses them: loads in flight, which a memory-bound pass needs.
constexpr int kUnroll = 4;

Plan plan(int64_t rows, int64_t cols, int pack) {
  Plan p;
  const int64_t packs = (cols + pack - 1) / pack;
  p.col_blocks = (packs + kColThreads - 1) / kColThreads;
  const int64_t want = int64_t(kBlocksPerSM) * multiprocessors();
  int64_t chunks = (want + p.col_blocks - 1) / p.col_blocks;
  const int64_t min_rows = int64_t(kRowThreads) * kMinRowsPerThread;
  int64_t max_chunks = (rows + min_rows - 1) / min_rows;
  if (max_chunks > kMaxChunks) max_chunks = kMaxChunks;
  chunks = chunks < 1 ? 1 : (chunks > max_chunks ? max_chunks : chunks);
  int64_t per = (rows + chunks - 1) / chunks;
  per = (per + kRowThreads - 1) / kRowThreads * kRowThreads;
  p.rows_per_chunk = per;
  p.chunks = (rows + per - 1) / per;
  return p;
}

template <typename T, int P>
__global__ void __launch_bounds__(kColThreads * kRowThreads)
    relu_bias_partial_kernel(const T* __restrict__ grad, const T* __restrict__ out, T* __restrict__ grad_pre,
                             acc_t<T>* __restrict__ partial, T* __restrict__ grad_bias, int64_t rows, int64_t cols,
                             int64_t rows_per_chunk) {
  using A = acc_t<T>;
  using V = Pack<T, P>;
  __shared__ A sums[kRowThreads][kColThreads * P];
  const int64_t col = (int64_t(blockIdx.x) * kColThreads + threadIdx.x) * P;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  A acc[P];
#pragma unroll
  for (int k = 0; k < P; ++k) acc[k] = A(0);
  if (col < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowThreads * kUnroll) {
      V g[kUnroll], o[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t rr = r + u * kRowThreads;
        if (rr < r1) {
          const int64_t i = (rr * cols + col) / P;
          g[u] = reinterpret_cast<const V*>(grad)[i];
          o[u] = reinterpret_cast<const V*>(out)[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t rr = r + u * kRowThreads;
        if (rr < r1) {
          V d;
#pragma unroll
          for (int k = 0; k < P; ++k) {
            // As threshold_backward: zero where out <= 0, the gradient elsewhere (NaN out included).
            const bool off = to_acc(o[u].v[k]) <= A(0);
            d.v[k] = off ? from_acc<T>(A(0)) : g[u].v[k];
            acc[k] += off ? A(0) : to_acc(g[u].v[k]);
          }
          reinterpret_cast<V*>(grad_pre)[(rr * cols + col) / P] = d;
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < P; ++k) sums[threadIdx.y][threadIdx.x * P + k] = acc[k];
  __syncthreads();
  // The 8 row threads' sums of a column, in order: threads (x, y) take columns y, y + 8, ... of the block.
  for (int c = threadIdx.y * kColThreads + threadIdx.x; c < kColThreads * P; c += kColThreads * kRowThreads) {
    const int64_t gc = int64_t(blockIdx.x) * kColThreads * P + c;
    if (gc >= cols) continue;
    A s = A(0);
#pragma unroll
    for (int y = 0; y < kRowThreads; ++y) s += sums[y][c];
    if (partial != nullptr) {
      partial[int64_t(blockIdx.y) * cols + gc] = s;
    } else {
      grad_bias[gc] = from_acc<T>(s);
    }
  }
}

template <typename T>
__global__ void relu_bias_finish_kernel(const acc_t<T>* __restrict__ partial, T* __restrict__ grad_bias,
                                        int64_t chunks, int64_t cols) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  acc_t<T> s = 0;
#pragma unroll 4
  for (int64_t j = 0; j < chunks; ++j) s += partial[j * cols + c];
  grad_bias[c] = from_acc<T>(s);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
int pack_for(const void* grad, const void* out, const void* grad_pre, int64_t cols) {
  constexpr int P = kPackOf<T>;
  return cols % P == 0 && aligned16(grad) && aligned16(out) && aligned16(grad_pre) ? P : 1;
}

template <typename T, int P>
cudaError_t launch_typed(const T* grad, const T* out, T* grad_pre, T* grad_bias, void* workspace,
                         int64_t workspace_bytes, int64_t rows, int64_t cols, cudaStream_t stream) {
  const Plan p = plan(rows, cols, P);
  if (p.col_blocks > INT_MAX || p.chunks > 65535) return cudaErrorInvalidConfiguration;
  // The caller sized the workspace for either plan (relu_bias_workspace_bytes); a smaller one is refused,
  // never written past.
  if (p.chunks > 1 && (workspace == nullptr || workspace_bytes < p.chunks * cols * int64_t(sizeof(acc_t<T>)))) {
    return cudaErrorInvalidValue;
  }
  acc_t<T>* partial = p.chunks > 1 ? static_cast<acc_t<T>*>(workspace) : nullptr;
  const dim3 grid(static_cast<unsigned>(p.col_blocks), static_cast<unsigned>(p.chunks));
  relu_bias_partial_kernel<T, P><<<grid, dim3(kColThreads, kRowThreads), 0, stream>>>(
      grad, out, grad_pre, partial, grad_bias, rows, cols, p.rows_per_chunk);
  if (partial != nullptr) {
    const int64_t blocks = (cols + 255) / 256;
    if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
    relu_bias_finish_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(partial, grad_bias, p.chunks, cols);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_cast(const void* grad, const void* out, void* grad_pre, void* grad_bias, void* workspace,
                        int64_t workspace_bytes, int64_t rows, int64_t cols, cudaStream_t stream) {
  const T* g = static_cast<const T*>(grad);
  const T* o = static_cast<const T*>(out);
  T* gp = static_cast<T*>(grad_pre);
  T* gb = static_cast<T*>(grad_bias);
  if (pack_for<T>(grad, out, grad_pre, cols) > 1) {
    return launch_typed<T, kPackOf<T>>(g, o, gp, gb, workspace, workspace_bytes, rows, cols, stream);
  }
  return launch_typed<T, 1>(g, o, gp, gb, workspace, workspace_bytes, rows, cols, stream);
}

}  // namespace

int64_t relu_bias_workspace_bytes(int64_t rows, int64_t cols, DType dtype) {
  if (rows <= 0 || cols <= 0) return 0;
  // The pack the launch takes depends on the pointers' alignment, not known here: room for either plan.
  // 16-byte packs make the fewest column blocks, hence the most row chunks.
  const int64_t chunks = plan(rows, cols, 16 / elem_bytes(dtype)).chunks;
  const int64_t acc_bytes = dtype == DType::Float64 ? 8 : 4;
  return chunks > 1 ? chunks * cols * acc_bytes : 0;
}

cudaError_t launch_relu_bias_backward(const void* grad, const void* out, void* grad_pre, void* grad_bias,
                                      void* workspace, int64_t workspace_bytes, int64_t rows, int64_t cols,
                                      DType dtype, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t w = workspace_bytes;
  switch (dtype) {
    case DType::Float32:
      return launch_cast<float>(grad, out, grad_pre, grad_bias, workspace, w, rows, cols, stream);
    case DType::Float16:
      return launch_cast<__half>(grad, out, grad_pre, grad_bias, workspace, w, rows, cols, stream);
    case DType::BFloat16:
      return launch_cast<__nv_bfloat16>(grad, out, grad_pre, grad_bias, workspace, w, rows, cols, stream);
    case DType::Float64:
      return launch_cast<double>(grad, out, grad_pre, grad_bias, workspace, w, rows, cols, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace opb::fused_matmul_add_relu
