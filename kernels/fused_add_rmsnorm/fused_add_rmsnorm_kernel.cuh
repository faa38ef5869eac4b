// fused_add_rmsnorm on the GPU: device code only; no torch headers.
//
//   h            = round_to_T(input + residual)        (residual_out; h = input for plain RMSNorm)
//   rstd         = rsqrt(mean(h^2) + eps)                (fp32 accumulation; fp64 for double)
//   out          = h * rstd * weight
//
// The norm is taken of the *rounded* h, the value written to residual_out: out is exactly
// rms_norm(residual_out), which is what an unfused model (h = x + r in the model's dtype, then RMSNorm)
// computes, and the next layer's residual is the tensor that was normalised.
//
// Backward, with g = grad_out * weight and n = h * rstd:
//   grad_h      = rstd * g - h * rstd^3 * mean(g * h) + grad_residual_out   (= grad_input = grad_residual)
//   grad_weight = sum over rows of grad_out * n
//
// Two families of kernels:
//  * "rows" kernels keep a whole row in registers (16-byte packs, NV packs per thread). tpr threads own
//    a row: tpr <= 32 packs several rows into each warp (reductions are shuffles only); tpr > 32 is a
//    multiple of 32 and the block is one row (one __syncthreads per reduction). Forward: up to 8 packs
//    x 512 threads (32768 bf16/fp16, 16384 fp32); backward: 2 packs x 512 threads (8192 / 4096).
//  * "loop" kernels handle any hidden size (odd sizes, rows too long for registers, float64): one block
//    per row, re-reading the row (from L1/L2) instead of holding it.
// The weight gradient is summed per block into a [blocks, hidden] fp32 workspace, then over blocks by a
// second small kernel, in a fixed order (deterministic run to run).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cuda_types.cuh"

namespace opb::fused_add_rmsnorm {

// ---- element types -------------------------------------------------------------------------------

using opb::acc_t;
using opb::from_acc;
using opb::to_acc;

__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return rsqrt(v); }

// N consecutive elements moved as one load/store: N = 16 / sizeof(T) (a 16-byte pack) or 1 (scalar).
template <typename T, int N_>
struct alignas(sizeof(T) * N_) Vec {
  static constexpr int N = N_;
  T v[N_];
};

template <typename T>
constexpr int kPack = 16 / static_cast<int>(sizeof(T));

// out.v[k] = round_to_T(f[k]); half and bf16 two at a time (one cvt.rn.*x2.f32 each).
template <typename T, int N>
__device__ __forceinline__ void from_acc_n(Vec<T, N>& out, const acc_t<T> (&f)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      const __nv_bfloat162 p = __floats2bfloat162_rn(f[k], f[k + 1]);
      memcpy(&out.v[k], &p, sizeof(p));
    }
  } else if constexpr (std::is_same_v<T, __half> && N % 2 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      const __half2 p = __floats2half2_rn(f[k], f[k + 1]);
      memcpy(&out.v[k], &p, sizeof(p));
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = from_acc<T>(f[k]);
  }
}

// Streaming load (read once, evict first) of vector i of p.
template <typename V, typename T>
__device__ __forceinline__ V load_stream(const T* p, int64_t i) {
  if constexpr (sizeof(V) == 16) {
    uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p) + i);
    V v;
    memcpy(&v, &raw, 16);
    return v;
  } else {
    return reinterpret_cast<const V*>(p)[i];
  }
}

// Cached load: the weight, read by every row.
template <typename V, typename T>
__device__ __forceinline__ V load_cached(const T* p, int64_t i) {
  if constexpr (sizeof(V) == 16) {
    uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + i);
    V v;
    memcpy(&v, &raw, 16);
    return v;
  } else {
    return reinterpret_cast<const V*>(p)[i];
  }
}

template <typename V, typename T>
__device__ __forceinline__ void store(T* p, int64_t i, const V& v) {
  reinterpret_cast<V*>(p)[i] = v;
}

// A store of vector i of p: evict-first (st.global.cs) when CS, else plain.
template <bool CS, typename V, typename T>
__device__ __forceinline__ void store_row(T* p, int64_t i, const V& v) {
  if constexpr (CS && sizeof(V) == 16) {
    uint4 raw;
    memcpy(&raw, &v, 16);
    __stcs(reinterpret_cast<uint4*>(p) + i, raw);
  } else {
    store(p, i, v);
  }
}

// ---- reductions ----------------------------------------------------------------------------------

template <typename A>
__device__ __forceinline__ A group_sum(A v, int width) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (o < width) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// Sum of a and b over the tpr threads that own a row; every one of them gets the totals.
// tpr <= 32: a power of two, rows packed inside warps. tpr > 32: the whole block (blockDim.x == tpr).
// buf: 64 A in shared memory. A caller that reduces more than once alternates two buffers, so that a
// fast warp cannot overwrite values a slow warp has not read yet, without a second __syncthreads.
template <typename A>
__device__ __forceinline__ void row_sum2(A& a, A& b, int tpr, A* buf) {
  a = group_sum(a, tpr < 32 ? tpr : 32);
  b = group_sum(b, tpr < 32 ? tpr : 32);
  if (tpr <= 32) return;
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    buf[warp] = a;
    buf[32 + warp] = b;
  }
  __syncthreads();
  A ta = 0, tb = 0;
  const int warps = blockDim.x >> 5;
  for (int i = 0; i < warps; ++i) {
    ta += buf[i];
    tb += buf[32 + i];
  }
  a = ta;
  b = tb;
}

// TPR > 0: the block size, known at compile time (the sum over warps unrolled).
template <int TPR, typename A>
__device__ __forceinline__ A row_sum(A a, int tpr, A* buf) {
  a = group_sum(a, tpr < 32 ? tpr : 32);
  if (tpr <= 32) return a;
  if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = a;
  __syncthreads();
  A t = 0;
  const int warps = (TPR > 0 ? TPR : blockDim.x) >> 5;
  for (int i = 0; i < warps; ++i) t += buf[i];
  return t;
}

// ---- forward -------------------------------------------------------------------------------------

// Vector i of p, read once: an evict-first load (__ldcs) or a plain one (the compiler makes it a
// read-only-path load, p being const __restrict__ in the kernels).
template <bool STREAM, typename V, typename T>
__device__ __forceinline__ V load_row(const T* p, int64_t i) {
  if constexpr (STREAM) {
    return load_stream<V>(p, i);
  } else {
    return reinterpret_cast<const V*>(p)[i];
  }
}

// input, residual (nullable), out, residual_out: [rows, nvec * P]; weight: [nvec * P]; 16-byte aligned.
// Block: (blockDim.x / tpr) rows of tpr threads; thread `lane` of a row owns packs lane + j * tpr.
// W_EARLY: the weight is loaded with the row, before the reduction, instead of after it (off the row's
// critical path, for NV more registers). STREAM: __ldcs loads of input and residual, else plain loads.
// TPR > 0: tpr known at compile time (index math by shifts, the reduction unrolled); 0: tpr_arg.
// ST_CS: evict-first stores of out and residual_out, else plain ones.
template <typename T, int NV, bool W_EARLY, bool STREAM, int TPR = 0, bool ST_CS = false>
__global__ void __launch_bounds__(512)
    forward_rows_kernel(const T* __restrict__ input, const T* __restrict__ residual, const T* __restrict__ weight,
                        T* __restrict__ out, T* __restrict__ residual_out, int64_t rows, int nvec, int tpr_arg,
                        float inv_hidden, float eps) {
  using V = Vec<T, kPack<T>>;
  constexpr int P = V::N;
  const int tpr = TPR > 0 ? TPR : tpr_arg;
  __shared__ float buf[64];
  const int lane = threadIdx.x % tpr;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / tpr) + threadIdx.x / tpr;
  const bool live = row < rows;
  const int64_t base = row * nvec;

  V h[NV], w[NV];
  float ss = 0.f;
  {
    V a[NV], b[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int idx = lane + j * tpr;
      if (live && idx < nvec) {
        a[j] = load_row<STREAM, V>(input, base + idx);
        if (residual != nullptr) b[j] = load_row<STREAM, V>(residual, base + idx);
        if (W_EARLY) w[j] = load_cached<V>(weight, idx);
      }
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int idx = lane + j * tpr;
      if (live && idx < nvec) {
        if (residual != nullptr) {
          float f[P];
#pragma unroll
          for (int k = 0; k < P; ++k) f[k] = to_acc(a[j].v[k]) + to_acc(b[j].v[k]);
          from_acc_n(h[j], f);
          store_row<ST_CS>(residual_out, base + idx, h[j]);
        } else {
          h[j] = a[j];
        }
#pragma unroll
        for (int k = 0; k < P; ++k) {
          const float v = to_acc(h[j].v[k]);
          ss += v * v;
        }
      }
    }
  }
  ss = row_sum<TPR>(ss, tpr, buf);
  const float rstd = rsqrt_acc(ss * inv_hidden + eps);
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int idx = lane + j * tpr;
    if (live && idx < nvec) {
      if (!W_EARLY) w[j] = load_cached<V>(weight, idx);
      float f[P];
#pragma unroll
      for (int k = 0; k < P; ++k) f[k] = to_acc(h[j].v[k]) * rstd * to_acc(w[j].v[k]);
      V o;
      from_acc_n(o, f);
      store_row<ST_CS>(out, base + idx, o);
    }
  }
}

// Any hidden size: one block per row. N = kPack<T> when hidden % N == 0 and the buffers are 16-byte
// aligned, else 1. Pass 1 writes residual_out; pass 2 reads it back (the same thread's own writes,
// still in L1/L2) instead of holding the row.
template <typename T, int N>
__global__ void __launch_bounds__(1024)
    forward_loop_kernel(const T* __restrict__ input, const T* __restrict__ residual, const T* __restrict__ weight,
                        T* __restrict__ out, T* __restrict__ residual_out, int64_t hidden, acc_t<T> inv_hidden,
                        acc_t<T> eps) {
  using A = acc_t<T>;
  using V = Vec<T, N>;
  __shared__ A buf[64];
  const int64_t units = hidden / N;
  const int64_t base = int64_t(blockIdx.x) * units;
  A ss = 0;
  for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
    V h = load_stream<V>(input, base + i);
    if (residual != nullptr) {
      const V b = load_stream<V>(residual, base + i);
      A f[N];
#pragma unroll
      for (int k = 0; k < N; ++k) f[k] = to_acc(h.v[k]) + to_acc(b.v[k]);
      from_acc_n(h, f);
      store(residual_out, base + i, h);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const A v = to_acc(h.v[k]);
      ss += v * v;
    }
  }
  ss = row_sum<0>(ss, static_cast<int>(blockDim.x), buf);
  const A rstd = rsqrt_acc(ss * inv_hidden + eps);
  const T* src = residual != nullptr ? residual_out : input;
  for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
    // A plain load: with a residual, src is this thread's own earlier store.
    const V h = reinterpret_cast<const V*>(src)[base + i];
    const V w = load_cached<V>(weight, i);
    A f[N];
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = to_acc(h.v[k]) * rstd * to_acc(w.v[k]);
    V o;
    from_acc_n(o, f);
    store(out, base + i, o);
  }
}

// ---- backward ------------------------------------------------------------------------------------

// grad_out, grad_res (nullable), h, grad_h, grad_h2 (nullable): [rows, nvec * P]; weight: [nvec * P];
// 16-byte aligned. grad_h2 gets a second copy of grad_h, stored from the same registers: autograd needs
// one tensor each for input and residual, and given one tensor twice it would clone it (a read and a
// write, where this is one write).
// Blocks loop over rows (grid = what fits on the GPU at once), so each block sums the weight gradient
// of many rows before writing one row of partial: [gridDim.x, hidden] fp32. The running sums live in
// dynamic shared memory, [rows per block, hidden] floats, each entry touched only by its owner thread
// until the end (registers are kept for the row itself: at most 64 a thread, 1024 threads an SM).
template <typename T, int NV>
__global__ void __launch_bounds__(512, 2)
    backward_rows_kernel(const T* __restrict__ grad_out, const T* __restrict__ grad_res, const T* __restrict__ h,
                         const T* __restrict__ weight, T* __restrict__ grad_h, T* __restrict__ grad_h2,
                         float* __restrict__ partial, int64_t rows, int nvec, int tpr, float inv_hidden, float eps) {
  using V = Vec<T, kPack<T>>;
  constexpr int P = V::N;
  using F = Vec<float, P>;
  __shared__ float buf[2][64];
  extern __shared__ float4 dw_smem4[];
  float* dw_smem = reinterpret_cast<float*>(dw_smem4);
  const int rpb = blockDim.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int slot = threadIdx.x / tpr;
  const int64_t hidden = int64_t(nvec) * P;
  F* my_dw = reinterpret_cast<F*>(dw_smem + slot * hidden);  // this row slot's sums, one F per pack

#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int idx = lane + j * tpr;
    if (idx < nvec) {
      F z;
#pragma unroll
      for (int k = 0; k < P; ++k) z.v[k] = 0.f;
      my_dw[idx] = z;
    }
  }

  int parity = 0;
  for (int64_t row0 = int64_t(blockIdx.x) * rpb; row0 < rows; row0 += int64_t(gridDim.x) * rpb) {
    const int64_t row = row0 + slot;
    const bool live = row < rows;
    const int64_t base = row * nvec;
    V hv[NV], gv[NV], rv[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int idx = lane + j * tpr;
      if (live && idx < nvec) {
        hv[j] = load_stream<V>(h, base + idx);
        gv[j] = load_stream<V>(grad_out, base + idx);
        if (grad_res != nullptr) rv[j] = load_stream<V>(grad_res, base + idx);
      }
    }
    float shh = 0.f, sgh = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int idx = lane + j * tpr;
      if (live && idx < nvec) {
        const V wv = load_cached<V>(weight, idx);
#pragma unroll
        for (int k = 0; k < P; ++k) {
          const float hk = to_acc(hv[j].v[k]);
          shh += hk * hk;
          sgh += to_acc(gv[j].v[k]) * to_acc(wv.v[k]) * hk;
        }
      }
    }
    row_sum2(shh, sgh, tpr, buf[parity]);
    parity ^= 1;
    const float rstd = rsqrt_acc(shh * inv_hidden + eps);
    const float c = sgh * inv_hidden * rstd * rstd * rstd;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int idx = lane + j * tpr;
      if (live && idx < nvec) {
        const V wv = load_cached<V>(weight, idx);
        F acc = my_dw[idx];
        float d[P];
#pragma unroll
        for (int k = 0; k < P; ++k) {
          const float hk = to_acc(hv[j].v[k]);
          const float gk = to_acc(gv[j].v[k]);
          d[k] = rstd * gk * to_acc(wv.v[k]) - c * hk;
          if (grad_res != nullptr) d[k] += to_acc(rv[j].v[k]);
          acc.v[k] += gk * hk * rstd;
        }
        V o;
        from_acc_n(o, d);
        store(grad_h, base + idx, o);
        if (grad_h2 != nullptr) store(grad_h2, base + idx, o);
        my_dw[idx] = acc;
      }
    }
  }

  // This block's row of partial sums: its row slots added in a fixed order.
  __syncthreads();
  float* dst = partial + int64_t(blockIdx.x) * hidden;
  for (int64_t col = threadIdx.x; col < hidden; col += blockDim.x) {
    float s = 0.f;
    for (int sl = 0; sl < rpb; ++sl) s += dw_smem[sl * hidden + col];
    dst[col] = s;
  }
}

// Any hidden size, pass 1 of 2: per-row statistics. One block per row.
// stats: [rows, 2] = (rstd, mean(g * h) * rstd^3).
template <typename T, int N>
__global__ void __launch_bounds__(1024)
    backward_stats_kernel(const T* __restrict__ grad_out, const T* __restrict__ h, const T* __restrict__ weight,
                          acc_t<T>* __restrict__ stats, int64_t hidden, acc_t<T> inv_hidden, acc_t<T> eps) {
  using A = acc_t<T>;
  using V = Vec<T, N>;
  __shared__ A buf[64];
  const int64_t units = hidden / N;
  const int64_t base = int64_t(blockIdx.x) * units;
  A shh = 0, sgh = 0;
  for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
    const V hv = load_stream<V>(h, base + i);
    const V gv = load_stream<V>(grad_out, base + i);
    const V wv = load_cached<V>(weight, i);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const A hk = to_acc(hv.v[k]);
      shh += hk * hk;
      sgh += to_acc(gv.v[k]) * to_acc(wv.v[k]) * hk;
    }
  }
  row_sum2(shh, sgh, static_cast<int>(blockDim.x), buf);
  if (threadIdx.x == 0) {
    const A rstd = rsqrt_acc(shh * inv_hidden + eps);
    stats[2 * blockIdx.x] = rstd;
    stats[2 * blockIdx.x + 1] = sgh * inv_hidden * rstd * rstd * rstd;
  }
}

// Any hidden size, pass 2 of 2: grad_h (and grad_h2, nullable: its copy) elementwise, and the weight
// gradient of a tile of (rows_per_chunk rows) x (blockDim.x vectors). Grid: (column tiles, row chunks).
// partial: [gridDim.y, hidden].
template <typename T, int N>
__global__ void __launch_bounds__(256)
    backward_tile_kernel(const T* __restrict__ grad_out, const T* __restrict__ grad_res, const T* __restrict__ h,
                         const T* __restrict__ weight, const acc_t<T>* __restrict__ stats, T* __restrict__ grad_h,
                         T* __restrict__ grad_h2, acc_t<T>* __restrict__ partial, int64_t rows, int64_t hidden,
                         int64_t rows_per_chunk) {
  using A = acc_t<T>;
  using V = Vec<T, N>;
  const int64_t units = hidden / N;
  const int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= units) return;
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;
  const V wv = load_cached<V>(weight, u);
  A dw[N];
#pragma unroll
  for (int k = 0; k < N; ++k) dw[k] = 0;
#pragma unroll 2
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t i = row * units + u;
    const V hv = load_stream<V>(h, i);
    const V gv = load_stream<V>(grad_out, i);
    V rv;
    if (grad_res != nullptr) rv = load_stream<V>(grad_res, i);
    const A rstd = stats[2 * row];
    const A c = stats[2 * row + 1];
    A d[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const A hk = to_acc(hv.v[k]);
      const A gk = to_acc(gv.v[k]);
      d[k] = rstd * gk * to_acc(wv.v[k]) - c * hk;
      if (grad_res != nullptr) d[k] += to_acc(rv.v[k]);
      dw[k] += gk * hk * rstd;
    }
    V o;
    from_acc_n(o, d);
    store(grad_h, i, o);
    if (grad_h2 != nullptr) store(grad_h2, i, o);
  }
  A* dst = partial + int64_t(blockIdx.y) * hidden + u * N;
#pragma unroll
  for (int k = 0; k < N; ++k) dst[k] = dw[k];
}

// grad_weight[c] = sum over p of partial[p, c], in a fixed order. Block: 32 columns x 32 row slices.
template <typename T>
__global__ void __launch_bounds__(1024)
    weight_grad_kernel(const acc_t<T>* __restrict__ partial, T* __restrict__ grad_weight, int64_t parts,
                       int64_t hidden) {
  using A = acc_t<T>;
  __shared__ A sums[32][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  A s = 0;
  if (col < hidden) {
#pragma unroll 4
    for (int64_t p = threadIdx.y; p < parts; p += 32) s += partial[p * hidden + col];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    A t = 0;
#pragma unroll
    for (int i = 0; i < 32; ++i) t += sums[i][threadIdx.x];
    grad_weight[col] = from_acc<T>(t);
  }
}

}  // namespace opb::fused_add_rmsnorm
