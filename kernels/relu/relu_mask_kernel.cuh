// relu with its sign mask (relu_mask.h) and the backward from that mask. Device code only.
#pragma once

#include <cstdint>
#include <cstring>

#include "relu_kernel.cuh"

namespace opb::relu {

// P elements of T (one 16-byte pack) starting at element e of p, n elements in all. VEC: p + e is
// 16-byte aligned, so a full pack is one load; else (and for the last, partial pack) one element at a
// time, with the missing ones 0.
template <typename T, bool VEC>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, int64_t e, int64_t n, T (&v)[16 / sizeof(T)]) {
  constexpr int P = 16 / sizeof(T);
  if (VEC && e + P <= n) {
    const uint4 u = *reinterpret_cast<const uint4*>(p + e);
    memcpy(v, &u, sizeof(u));
  } else {
#pragma unroll
    for (int k = 0; k < P; ++k) v[k] = e + k < n ? p[e + k] : from_acc<T>(0);
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void store_pack(T* __restrict__ p, int64_t e, int64_t n, const T (&v)[16 / sizeof(T)]) {
  constexpr int P = 16 / sizeof(T);
  if (VEC && e + P <= n) {
    uint4 u;
    memcpy(&u, v, sizeof(u));
    *reinterpret_cast<uint4*>(p + e) = u;
  } else {
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (e + k < n) p[e + k] = v[k];
  }
}

// A warp a tile, UNROLL tiles a warp (each warp's tiles loaded before any is stored). Launch with a
// multiple of 32 threads; `tiles` = ceil(n / (32 * P)).
template <typename T, bool VEC, int UNROLL>
__global__ void relu_mask_kernel(const T* __restrict__ x, T* __restrict__ y, uint32_t* __restrict__ mask,
                                 int64_t n, int64_t tiles) {
  constexpr int P = 16 / sizeof(T);
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t t0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t0 < tiles; t0 += warps * UNROLL) {
    T v[UNROLL][P];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t t = t0 + u * warps;
      if (t < tiles) load_pack<T, VEC>(x, t * 32 * P + lane * P, n, v[u]);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t t = t0 + u * warps;
      if (t >= tiles) break;  // the same for the whole warp: the votes below see every lane
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        v[u][k] = relu1(v[u][k]);
        const uint32_t vote = __ballot_sync(0xffffffffu, !(to_acc(v[u][k]) <= 0));  // NaN: 1
        if (lane == k) word = vote;
      }
      store_pack<T, VEC>(y, t * 32 * P + lane * P, n, v[u]);
      if (lane < P) mask[t * P + lane] = word;
    }
  }
}

// grad_x = grad_y where the mask's bit is 1, else 0. Same tiling as relu_mask_kernel.
template <typename T, bool VEC, int UNROLL>
__global__ void relu_mask_backward_kernel(const T* __restrict__ dy, const uint32_t* __restrict__ mask,
                                          T* __restrict__ dx, int64_t n, int64_t tiles) {
  constexpr int P = 16 / sizeof(T);
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t t0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t0 < tiles; t0 += warps * UNROLL) {
    T g[UNROLL][P];
    uint32_t w[UNROLL][P];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t t = t0 + u * warps;
      if (t < tiles) {
        load_pack<T, VEC>(dy, t * 32 * P + lane * P, n, g[u]);
        // The tile's P words: the same 4P bytes for every lane (broadcast loads); `mask` is 16-byte
        // aligned, so a tile's words are 4P-byte aligned.
        if constexpr (P == 2) {
          const uint2 m = *reinterpret_cast<const uint2*>(mask + t * P);
          w[u][0] = m.x;
          w[u][1] = m.y;
        } else {
#pragma unroll
          for (int j = 0; j < P / 4; ++j) {
            const uint4 m = reinterpret_cast<const uint4*>(mask + t * P)[j];
            w[u][4 * j] = m.x;
            w[u][4 * j + 1] = m.y;
            w[u][4 * j + 2] = m.z;
            w[u][4 * j + 3] = m.w;
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t t = t0 + u * warps;
      if (t >= tiles) break;
#pragma unroll
      for (int k = 0; k < P; ++k) g[u][k] = (w[u][k] >> lane) & 1u ? g[u][k] : from_acc<T>(0);
      store_pack<T, VEC>(dx, t * 32 * P + lane * P, n, g[u]);
    }
  }
}

}  // namespace opb::relu
