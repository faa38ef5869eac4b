// fused_relu_layernorm on the GPU: y = layer_norm(relu(x)) over the last dim, and its backward.
// Device code only; no torch headers.
//
// Shapes (row-major, contiguous):
//   x, y, dy, dx: [rows, hidden]     weight, bias: [hidden] or null (elementwise_affine=False)
//   mean, rstd:   [rows], in Acc (float for fp32/fp16/bf16, double for fp64)
//   dw_part, db_part: [n_part, hidden] Acc partial sums of the weight/bias gradients, one row per CTA
//
// Two families of kernels:
//   *_reg: the row lives in registers (NV packs of VEC elements per thread, TPR threads per row).
//          One read of x per pass of the op; variance by Chan's merge of each thread's exact stats.
//   *_any: any hidden size (huge rows, odd types): the row is streamed from global memory twice
//          (the second read is mostly an L2 hit); variance by Chan's pairwise merge of per-pack stats.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cuda_types.cuh"

namespace opb::fused_relu_layernorm {

// ---- element conversions (torch passes -D__CUDA_NO_*_CONVERSIONS__: convert explicitly) ----------

using opb::from_acc;
using opb::to_acc;

// relu that keeps NaN (as torch.relu does): `v < 0` is false for NaN.
template <typename A>
__device__ __forceinline__ A relu(A v) { return v < A(0) ? A(0) : v; }

template <typename A>
__device__ __forceinline__ A rsqrt_acc(A v);
template <>
__device__ __forceinline__ float rsqrt_acc<float>(float v) { return rsqrtf(v); }
template <>
__device__ __forceinline__ double rsqrt_acc<double>(double v) { return rsqrt(v); }

// ---- packed loads and stores: N elements of T in one access of N * sizeof(T) bytes ------------

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Streaming (evict-first) load of data read exactly once; plain load of data read again soon.
template <bool STREAM, typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  Pack<T, N> out;
  constexpr int kBytes = sizeof(T) * N;
  if constexpr (kBytes == 16) {
    uint4 u = STREAM ? __ldcs(reinterpret_cast<const uint4*>(p)) : __ldg(reinterpret_cast<const uint4*>(p));
    *reinterpret_cast<uint4*>(&out) = u;
  } else if constexpr (kBytes == 8) {
    uint2 u = STREAM ? __ldcs(reinterpret_cast<const uint2*>(p)) : __ldg(reinterpret_cast<const uint2*>(p));
    *reinterpret_cast<uint2*>(&out) = u;
  } else if constexpr (kBytes == 4) {
    unsigned u = STREAM ? __ldcs(reinterpret_cast<const unsigned*>(p)) : __ldg(reinterpret_cast<const unsigned*>(p));
    *reinterpret_cast<unsigned*>(&out) = u;
  } else if constexpr (kBytes == 2) {
    unsigned short u = STREAM ? __ldcs(reinterpret_cast<const unsigned short*>(p))
                              : __ldg(reinterpret_cast<const unsigned short*>(p));
    *reinterpret_cast<unsigned short*>(&out) = u;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = p[k];
  }
  return out;
}

// A pack of 16- or 32-bit elements held in registers as the words it was loaded in, widened to float
// one element at a time where it is used: 8 bf16/fp16 then take 4 registers, where the compiler splits
// a Pack into 8, one per element.
template <typename T, int N>
struct Words {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "16- or 32-bit elements");
  unsigned u[(sizeof(T) * N + 3) / 4];

  __device__ __forceinline__ void set(const Pack<T, N>& p) {
    if constexpr (sizeof(p) >= 4) {
      memcpy(u, &p, sizeof(u));
    } else {
      unsigned short h;
      memcpy(&h, &p, sizeof(h));
      u[0] = h;
    }
  }
  // Every element = v.
  __device__ __forceinline__ void fill(float v) {
    Pack<T, N> p;
#pragma unroll
    for (int k = 0; k < N; ++k) p.v[k] = from_acc<T>(v);
    set(p);
  }
  // Element k (a constant once the caller's loop is unrolled).
  __device__ __forceinline__ float at(int k) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(u[k]);
    } else {
      const unsigned bits = k % 2 ? u[k / 2] >> 16 : u[k / 2] & 0xffffu;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(bits << 16);
      else return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    }
  }
};

// Streaming (evict-first) or plain store.
template <bool STREAM, typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& in) {
  constexpr int kBytes = sizeof(T) * N;
  if constexpr (!STREAM) {
    *reinterpret_cast<Pack<T, N>*>(p) = in;
  } else if constexpr (kBytes == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&in));
  } else if constexpr (kBytes == 8) {
    __stcs(reinterpret_cast<uint2*>(p), *reinterpret_cast<const uint2*>(&in));
  } else if constexpr (kBytes == 4) {
    __stcs(reinterpret_cast<unsigned*>(p), *reinterpret_cast<const unsigned*>(&in));
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = in.v[k];
  }
}

// ---- reductions ---------------------------------------------------------------------------------

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Two sums at once over the WARPS warps of a row (one barrier instead of two).
template <int WARPS>
__device__ __forceinline__ float2 row_sum2(float a, float b, float2* smem) {
  a = warp_sum(a);
  b = warp_sum(b);
  if constexpr (WARPS == 1) {
    return make_float2(a, b);
  } else {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) smem[warp] = make_float2(a, b);
    __syncthreads();
    float2 s = smem[0];
#pragma unroll
    for (int i = 1; i < WARPS; ++i) {
      s.x += smem[i].x;
      s.y += smem[i].y;
    }
    return s;
  }
}

// Running statistics of a set of values: count, mean, sum of squared deviations.
template <typename A>
struct Stats {
  A n, mean, m2;
};

// 1 / n for a count n >= 1. In float the hardware's approximate reciprocal (within an ulp) alone: the
// correctly rounded one, and __fdividef too, add range checks and a slow path to every merge.
__device__ __forceinline__ float recip(float n) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(n));
  return r;
}
__device__ __forceinline__ double recip(double n) { return 1.0 / n; }

// Chan et al.'s pairwise merge: exact for any split, no E[x^2] - E[x]^2 cancellation. Empty sets are
// {0, 0, 0}. Symmetric to the bit (merge(a, b) == merge(b, a): each term is either symmetric or the
// product of two terms that both change sign), so both partners of a butterfly shuffle get the same
// result and every thread of a row ends with the same mean and rstd.
template <typename A>
__device__ __forceinline__ Stats<A> merge(Stats<A> a, Stats<A> b) {
  const A n = a.n + b.n;
  const A r = n > A(0) ? recip(n) : A(0);
  const A d = b.mean - a.mean;
  // (a.n a.mean + b.n b.mean) / n as the midpoint plus a correction that vanishes for equal counts.
  const A mean = (a.mean + b.mean) * A(0.5) + (b.n - a.n) * A(0.5) * r * d;
  // d * (d * w), not d * d * w: with one side empty, w = 0 and d is the other side's mean, whose square
  // may overflow.
  return {n, mean, a.m2 + b.m2 + d * (d * (a.n * b.n * r))};
}

// Merge over groups of SPAN consecutive lanes (a power of two <= 32); every lane gets its group's stats.
template <int SPAN = 32, typename A>
__device__ __forceinline__ Stats<A> warp_merge(Stats<A> s) {
#pragma unroll
  for (int off = SPAN / 2; off > 0; off >>= 1) {
    Stats<A> o{__shfl_xor_sync(0xffffffffu, s.n, off), __shfl_xor_sync(0xffffffffu, s.mean, off),
               __shfl_xor_sync(0xffffffffu, s.m2, off)};
    s = merge(s, o);
  }
  return s;
}

// As warp_merge, where both sides of every merge hold the same count (every lane the same number of
// elements): no count to exchange and no reciprocal. Symmetric to the bit as merge() is.
template <int SPAN = 32>
__device__ __forceinline__ Stats<float> warp_merge_even(Stats<float> s) {
#pragma unroll
  for (int off = SPAN / 2; off > 0; off >>= 1) {
    const float mean = __shfl_xor_sync(0xffffffffu, s.mean, off), m2 = __shfl_xor_sync(0xffffffffu, s.m2, off);
    const float d = mean - s.mean;
    s.mean = (s.mean + mean) * 0.5f;
    s.m2 = s.m2 + m2 + d * (d * (s.n * 0.5f));  // na * nb / n = n / 2 for equal counts
    s.n *= 2.f;
  }
  return s;
}

template <bool EVEN, int SPAN>
__device__ __forceinline__ Stats<float> lanes_merge(Stats<float> s) {
  if constexpr (EVEN) return warp_merge_even<SPAN>(s);
  else return warp_merge<SPAN>(s);
}

// Merge over the TPR threads of a row (whole warps; more than one: one barrier); every thread gets the
// same stats. `smem` must hold TPR / 32 entries and not be reused by the caller until the next
// __syncthreads(). EVEN: every thread holds the same number of elements.
template <int TPR, bool EVEN>
__device__ __forceinline__ Stats<float> row_merge(Stats<float> s, Stats<float>* smem) {
  constexpr int WARPS = TPR / 32;
  static_assert(TPR >= 32 && TPR <= 1024 && (TPR & (TPR - 1)) == 0, "TPR: a power of two, 32..1024");
  s = lanes_merge<EVEN, 32>(s);
  if constexpr (WARPS > 1) {
    if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = s;
    __syncthreads();
    s = lanes_merge<EVEN, WARPS>(smem[threadIdx.x % WARPS]);  // each warp merges all WARPS entries, like the others
  }
  return s;
}

// ---- forward, row in registers ------------------------------------------------------------------
//
// TPR threads per row, ROWS rows per CTA (ROWS > 1 only when TPR == 32: a warp per row, no barrier).
// Thread `lane` of a row holds packs i = 0..NV-1 at columns (i * TPR + lane) * VEC.
// VEC > 1 only when hidden % VEC == 0 and every pointer is 16-byte aligned.
// The mean and variance come from one merge of each thread's exact stats: one barrier, not two. With
// EVEN, each thread's own sums run in kAcc independent chains, so that the last rows to arrive (one
// wave of short rows) are not held up by a chain of NV * VEC dependent adds (bf16 768: 0.3-0.5 us;
// 3072: 0.8%). Without EVEN the chains measured 2% slower at 3072 and stay single.
// W_EARLY: the weight and bias are loaded with x, before the reduction, so that their round trip is
// off the row's critical path; it costs 2 * NV packs of registers while the row is reduced.
// EVEN: hidden == NV * TPR * VEC, so every thread holds NV full packs (the merge needs no counts).
// Plain loads and stores: `__ldcs` / `__stcs` measured no faster here, and slower for relu and
// add+RMSNorm (benchmarks/NOTES.md).
template <typename T, int VEC, int NV, int TPR, int ROWS, bool W_EARLY, bool EVEN>
__global__ void __launch_bounds__(TPR * ROWS)
    fwd_reg_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                   float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int hidden, float eps) {
  static_assert(TPR >= 32 && (ROWS == 1 || TPR == 32), "whole warps a row; several rows a CTA only at one warp");
  constexpr int kAcc = EVEN && NV * VEC >= 8 ? 4 : 1;
  __shared__ Stats<float> red[TPR / 32];

  const int lane = threadIdx.x % TPR;
  const int64_t row = int64_t(blockIdx.x) * ROWS + threadIdx.x / TPR;
  if (row >= rows) return;  // a whole warp (ROWS > 1) or the whole CTA (ROWS == 1): no barrier skipped
  const T* xr = x + row * hidden;
  // Without a weight (bias), ones (zeros): y's arithmetic is the same either way.
  auto load_wb = [&](Words<T, VEC>& pw, Words<T, VEC>& pb, int col) {
    if (w != nullptr) pw.set(load_pack<false, T, VEC>(w + col)); else pw.fill(1.f);
    if (b != nullptr) pb.set(load_pack<false, T, VEC>(b + col)); else pb.fill(0.f);
  };
  auto has = [&](int i) { return EVEN || (i * TPR + lane) * VEC < hidden; };
  Words<T, VEC> px[NV], pw[NV], pb[NV];
  int n = 0;  // this thread's elements
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * TPR + lane) * VEC;
    if (has(i)) {
      px[i].set(load_pack<false, T, VEC>(xr + col));
      if constexpr (W_EARLY) load_wb(pw[i], pb[i], col);
      n += VEC;
    }
  }

  // This thread's exact mean and squared deviations, then the row's.
  float acc[kAcc] = {};
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (has(i)) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[(i * VEC + k) % kAcc] += relu(px[i].at(k));
    }
  }
  float sum = acc[0];
#pragma unroll
  for (int j = 1; j < kAcc; ++j) sum += acc[j];
  const float own_mean = n > 0 ? sum * recip(float(n)) : 0.f;
#pragma unroll
  for (int j = 0; j < kAcc; ++j) acc[j] = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (has(i)) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = relu(px[i].at(k)) - own_mean;
        acc[(i * VEC + k) % kAcc] += d * d;
      }
    }
  }
  float m2 = acc[0];
#pragma unroll
  for (int j = 1; j < kAcc; ++j) m2 += acc[j];
  const Stats<float> st = row_merge<TPR, EVEN>(Stats<float>{float(n), own_mean, m2}, red);
  const float mean = st.mean;
  const float rstd = rsqrtf(st.m2 * recip(float(hidden)) + eps);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }

  T* yr = y + row * hidden;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * TPR + lane) * VEC;
    if (has(i)) {
      if constexpr (!W_EARLY) load_wb(pw[i], pb[i], col);
      Pack<T, VEC> out;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        out.v[k] = from_acc<T>((relu(px[i].at(k)) - mean) * rstd * pw[i].at(k) + pb[i].at(k));
      store_pack<false>(yr + col, out);
    }
  }
}

// ---- backward, row in registers, persistent CTAs ------------------------------------------------
//
// With r = relu(x), xhat = (r - mean) * rstd, g = dy * w:
//   dx = [x > 0] * rstd * (g - (xhat * sum(g * xhat) + sum(g)) / hidden)
//   dw = sum over rows of dy * xhat,  db = sum over rows of dy
// Each CTA walks rows with a grid stride and keeps its threads' dw/db columns in registers, then
// writes one partial row (dw_part/db_part[blockIdx.x]); reduce_partials_kernel sums the partials.
// Threads of one CTA own the same columns in every row they visit, which is what makes that work.
// The next row's x, dy, mean and rstd are loaded before the current row is worked on, so a CTA keeps
// memory busy through its own arithmetic and barriers.
template <typename T, int VEC, int NV, int TPR>
struct BwdRow {
  Pack<T, VEC> x[NV], dy[NV];
  float mean, rstd;

  __device__ __forceinline__ void load(const T* __restrict__ xs, const T* __restrict__ dys,
                                       const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                       int64_t row, int hidden, int lane) {
    const T* xr = xs + row * hidden;
    const T* dyr = dys + row * hidden;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < hidden) {
        x[i] = load_pack<true, T, VEC>(xr + col);
        dy[i] = load_pack<true, T, VEC>(dyr + col);
      }
    }
    mean = mean_in[row];
    rstd = rstd_in[row];
  }
};

template <typename T, int VEC, int NV, int TPR, int ROWS>
__global__ void __launch_bounds__(TPR * ROWS)
    bwd_reg_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                   const float* __restrict__ mean_in, const float* __restrict__ rstd_in, T* __restrict__ dx,
                   float* __restrict__ dw_part, float* __restrict__ db_part, int64_t rows, int hidden) {
  static_assert(ROWS == 1 || TPR == 32, "several rows per CTA only with a warp per row");
  constexpr int WARPS = TPR / 32;
  constexpr int kCols = TPR * NV * VEC;
  __shared__ float2 red[WARPS > 1 ? WARPS : 1];
  // Cross-row-slot sum of the partials (ROWS > 1 only): a warp per slot adds its columns in turn.
  __shared__ float sdw[ROWS > 1 ? kCols : 1];
  __shared__ float sdb[ROWS > 1 ? kCols : 1];

  const int lane = threadIdx.x % TPR;
  const int slot = threadIdx.x / TPR;
  const float inv_n = 1.f / float(hidden);

  Pack<T, VEC> pw[NV];
  const bool has_w = w != nullptr;
  if (has_w) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < hidden) pw[i] = load_pack<false, T, VEC>(w + col);
    }
  }
  float acc_w[NV][VEC], acc_b[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc_w[i][k] = acc_b[i][k] = 0.f;

  // This thread's rows: slot, slot + stride, ...; with ROWS == 1 every thread of the CTA has the same
  // rows, so the barriers in row_sum2 are reached by all or none.
  const int64_t stride = int64_t(gridDim.x) * ROWS;
  int64_t row = int64_t(blockIdx.x) * ROWS + slot;
  BwdRow<T, VEC, NV, TPR> cur;
  if (row < rows) cur.load(x, dy, mean_in, rstd_in, row, hidden, lane);
  for (; row < rows; row += stride) {
    BwdRow<T, VEC, NV, TPR> nxt;
    if (row + stride < rows) nxt.load(x, dy, mean_in, rstd_in, row + stride, hidden, lane);

    float s_gx = 0.f, s_g = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if ((i * TPR + lane) * VEC < hidden) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xhat = (relu(to_acc(cur.x[i].v[k])) - cur.mean) * cur.rstd;
          const float d = to_acc(cur.dy[i].v[k]);
          const float g = has_w ? d * to_acc(pw[i].v[k]) : d;
          s_gx += g * xhat;
          s_g += g;
          acc_w[i][k] += d * xhat;
          acc_b[i][k] += d;
        }
      }
    }
    const float2 sums = row_sum2<WARPS>(s_gx, s_g, red);
    const float c1 = sums.x * inv_n;
    const float c2 = sums.y * inv_n;

    T* dxr = dx + row * hidden;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < hidden) {
        Pack<T, VEC> out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xv = to_acc(cur.x[i].v[k]);
          const float xhat = (relu(xv) - cur.mean) * cur.rstd;
          const float d = to_acc(cur.dy[i].v[k]);
          const float g = has_w ? d * to_acc(pw[i].v[k]) : d;
          const float grad = cur.rstd * (g - (xhat * c1 + c2));
          out.v[k] = from_acc<T>(xv <= 0.f ? 0.f : grad);  // relu's gradient, as threshold_backward
        }
        store_pack<true>(dxr + col, out);
      }
    }
    cur = nxt;
    // The next row's sums reuse `red`: every thread must have read it first.
    if constexpr (WARPS > 1) __syncthreads();
  }

  if (dw_part == nullptr) return;
  float* pwp = dw_part + int64_t(blockIdx.x) * hidden;
  float* pbp = db_part + int64_t(blockIdx.x) * hidden;
  if constexpr (ROWS == 1) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < hidden) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          pwp[col + k] = acc_w[i][k];
          pbp[col + k] = acc_b[i][k];
        }
      }
    }
  } else {
    for (int s = 0; s < ROWS; ++s) {
      if (slot == s) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int col = (i * TPR + lane) * VEC;
          if (col < hidden) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              sdw[col + k] = (s == 0 ? 0.f : sdw[col + k]) + acc_w[i][k];
              sdb[col + k] = (s == 0 ? 0.f : sdb[col + k]) + acc_b[i][k];
            }
          }
        }
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < hidden; c += TPR * ROWS) {
      pwp[c] = sdw[c];
      pbp[c] = sdb[c];
    }
  }
}

// ---- any hidden size: one CTA per row (grid-stride), the row streamed from global memory ---------

// blockDim.x: a multiple of 32, at most 1024. Shared memory: 32 slots per reduction.
template <typename T, typename A, int VEC>
__global__ void __launch_bounds__(1024)
    fwd_any_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                   A* __restrict__ mean_out, A* __restrict__ rstd_out, int64_t rows, int64_t hidden, A eps) {
  __shared__ A sh_n[32], sh_mean[32], sh_m2[32];
  const int warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32;
  const int64_t step = int64_t(blockDim.x) * VEC;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * hidden;
    Stats<A> st{A(0), A(0), A(0)};
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < hidden; col += step) {
      Pack<T, VEC> p = load_pack<false, T, VEC>(xr + col);
      A r[VEC];
      A s = A(0);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        r[k] = relu(to_acc(p.v[k]));
        s += r[k];
      }
      const A m = s / A(VEC);
      A m2 = A(0);
#pragma unroll
      for (int k = 0; k < VEC; ++k) m2 += (r[k] - m) * (r[k] - m);
      st = merge(st, Stats<A>{A(VEC), m, m2});
    }
    st = warp_merge(st);
    if (threadIdx.x % 32 == 0) {
      sh_n[warp] = st.n;
      sh_mean[warp] = st.mean;
      sh_m2[warp] = st.m2;
    }
    __syncthreads();
    Stats<A> all{sh_n[0], sh_mean[0], sh_m2[0]};
    for (int i = 1; i < warps; ++i) all = merge(all, Stats<A>{sh_n[i], sh_mean[i], sh_m2[i]});
    __syncthreads();  // the shared slots are rewritten by the next row
    const A mean = all.mean;
    const A rstd = rsqrt_acc(all.m2 / A(hidden) + eps);
    if (threadIdx.x == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
    T* yr = y + row * hidden;
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < hidden; col += step) {
      Pack<T, VEC> p = load_pack<false, T, VEC>(xr + col);
      Pack<T, VEC> pw, pb;
      if (w != nullptr) pw = load_pack<false, T, VEC>(w + col);
      if (b != nullptr) pb = load_pack<false, T, VEC>(b + col);
      Pack<T, VEC> out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        A v = (relu(to_acc(p.v[k])) - mean) * rstd;
        if (w != nullptr) v *= to_acc(pw.v[k]);
        if (b != nullptr) v += to_acc(pb.v[k]);
        out.v[k] = from_acc<T>(v);
      }
      store_pack<true>(yr + col, out);
    }
  }
}

// dx only; dw/db come from dwdb_any_kernel.
template <typename T, typename A, int VEC>
__global__ void __launch_bounds__(1024)
    bwd_any_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                   const A* __restrict__ mean_in, const A* __restrict__ rstd_in, T* __restrict__ dx, int64_t rows,
                   int64_t hidden) {
  __shared__ A sh_a[32], sh_b[32];
  const int warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32;
  const int64_t step = int64_t(blockDim.x) * VEC;
  const A inv_n = A(1) / A(hidden);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * hidden;
    const T* dyr = dy + row * hidden;
    const A mean = mean_in[row];
    const A rstd = rstd_in[row];
    A s_gx = A(0), s_g = A(0);
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < hidden; col += step) {
      Pack<T, VEC> px = load_pack<false, T, VEC>(xr + col);
      Pack<T, VEC> pg = load_pack<false, T, VEC>(dyr + col);
      Pack<T, VEC> pw;
      if (w != nullptr) pw = load_pack<false, T, VEC>(w + col);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A xhat = (relu(to_acc(px.v[k])) - mean) * rstd;
        A g = to_acc(pg.v[k]);
        if (w != nullptr) g *= to_acc(pw.v[k]);
        s_gx += g * xhat;
        s_g += g;
      }
    }
    s_gx = warp_sum(s_gx);
    s_g = warp_sum(s_g);
    if (threadIdx.x % 32 == 0) {
      sh_a[warp] = s_gx;
      sh_b[warp] = s_g;
    }
    __syncthreads();
    A c1 = A(0), c2 = A(0);
    for (int i = 0; i < warps; ++i) {
      c1 += sh_a[i];
      c2 += sh_b[i];
    }
    __syncthreads();
    c1 *= inv_n;
    c2 *= inv_n;
    T* dxr = dx + row * hidden;
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < hidden; col += step) {
      Pack<T, VEC> px = load_pack<false, T, VEC>(xr + col);
      Pack<T, VEC> pg = load_pack<false, T, VEC>(dyr + col);
      Pack<T, VEC> pw;
      if (w != nullptr) pw = load_pack<false, T, VEC>(w + col);
      Pack<T, VEC> out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A xv = to_acc(px.v[k]);
        const A xhat = (relu(xv) - mean) * rstd;
        A g = to_acc(pg.v[k]);
        if (w != nullptr) g *= to_acc(pw.v[k]);
        const A d = rstd * (g - (xhat * c1 + c2));
        out.v[k] = from_acc<T>(xv <= A(0) ? A(0) : d);
      }
      store_pack<true>(dxr + col, out);
    }
  }
}

// Column sums over a chunk of rows: block (32, 8) covers 32 columns; blockIdx.y picks the chunk;
// writes dw_part/db_part[blockIdx.y, col].
template <typename T, typename A>
__global__ void __launch_bounds__(256)
    dwdb_any_kernel(const T* __restrict__ dy, const T* __restrict__ x, const A* __restrict__ mean_in,
                    const A* __restrict__ rstd_in, A* __restrict__ dw_part, A* __restrict__ db_part, int64_t rows,
                    int64_t hidden, int64_t rows_per_chunk) {
  __shared__ A sw[8][33], sb[8][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  A aw = A(0), ab = A(0);
  if (col < hidden) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      const A xhat = (relu(to_acc(x[r * hidden + col])) - mean_in[r]) * rstd_in[r];
      const A d = to_acc(dy[r * hidden + col]);
      aw += d * xhat;
      ab += d;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
#pragma unroll
    for (int i = 1; i < 8; ++i) {
      aw += sw[i][threadIdx.x];
      ab += sb[i][threadIdx.x];
    }
    dw_part[int64_t(blockIdx.y) * hidden + col] = aw;
    db_part[int64_t(blockIdx.y) * hidden + col] = ab;
  }
}

// dw[col] = sum over p of dw_part[p, col] (same for db); block (32, 16), in a fixed order.
template <typename T, typename A>
__global__ void __launch_bounds__(512)
    reduce_partials_kernel(const A* __restrict__ dw_part, const A* __restrict__ db_part, int64_t n_part,
                           int64_t hidden, T* __restrict__ dw, T* __restrict__ db) {
  __shared__ A sw[16][33], sb[16][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  A aw = A(0), ab = A(0);
  if (col < hidden) {
    for (int64_t p = threadIdx.y; p < n_part; p += 16) {
      aw += dw_part[p * hidden + col];
      ab += db_part[p * hidden + col];
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
#pragma unroll
    for (int i = 1; i < 16; ++i) {
      aw += sw[i][threadIdx.x];
      ab += sb[i][threadIdx.x];
    }
    dw[col] = from_acc<T>(aw);
    db[col] = from_acc<T>(ab);
  }
}

}  // namespace opb::fused_relu_layernorm
