// relu on the GPU: y = max(x, 0), NaN kept. Device code only; no torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "common/cuda_types.cuh"

namespace opb::relu {

template <typename T>
__device__ __forceinline__ T relu1(T v) {
  // `v < 0` is false for NaN, so NaN passes through as torch.relu does.
  return to_acc(v) < 0 ? from_acc<T>(0) : v;
}

// 16-byte vectors. A block takes chunks of THREADS * UNROLL vectors, striding by the grid (one chunk a
// block when the grid covers the tensor); each thread loads its UNROLL vectors before storing any, to keep
// loads in flight. STREAM: evict-first loads and stores (__ldcs/__stcs) instead of plain ones.
template <typename T, int THREADS, int UNROLL, bool STREAM>
__global__ void __launch_bounds__(THREADS) relu_vec_kernel(const uint4* __restrict__ x, uint4* __restrict__ y,
                                                           int64_t n_vec) {
  constexpr int kPer = sizeof(uint4) / sizeof(T);
  constexpr int64_t kChunk = int64_t(THREADS) * UNROLL;
  for (int64_t base = int64_t(blockIdx.x) * kChunk + threadIdx.x; base - threadIdx.x < n_vec;
       base += int64_t(gridDim.x) * kChunk) {
    uint4 buf[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t i = base + int64_t(u) * THREADS;
      if (i < n_vec) buf[u] = STREAM ? __ldcs(x + i) : x[i];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t i = base + int64_t(u) * THREADS;
      if (i < n_vec) {
        T* v = reinterpret_cast<T*>(&buf[u]);
#pragma unroll
        for (int k = 0; k < kPer; ++k) v[k] = relu1(v[k]);
        if (STREAM) {
          __stcs(y + i, buf[u]);
        } else {
          y[i] = buf[u];
        }
      }
    }
  }
}

// Scalar path: the tail after the vectors, or unaligned buffers.
template <typename T>
__global__ void relu_scalar_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = relu1(x[i]);
  }
}

}  // namespace opb::relu
