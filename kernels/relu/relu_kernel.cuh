// relu on the GPU: y = max(x, 0), NaN kept. Device code only; no torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace opb::relu {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ double to_float(double v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T zero();
template <>
__device__ __forceinline__ float zero<float>() { return 0.f; }
template <>
__device__ __forceinline__ double zero<double>() { return 0.0; }
template <>
__device__ __forceinline__ __half zero<__half>() { return __float2half(0.f); }
template <>
__device__ __forceinline__ __nv_bfloat16 zero<__nv_bfloat16>() { return __float2bfloat16(0.f); }

template <typename T>
__device__ __forceinline__ T relu1(T v) {
  // `v < 0` is false for NaN, so NaN passes through as torch.relu does.
  return to_float(v) < 0 ? zero<T>() : v;
}

// 16-byte vectors: each thread loads UNROLL of them before storing any, to keep loads in flight.
template <typename T, int UNROLL>
__global__ void __launch_bounds__(256) relu_vec_kernel(const uint4* __restrict__ x, uint4* __restrict__ y,
                                                       int64_t n_vec) {
  constexpr int kPer = sizeof(uint4) / sizeof(T);
  int64_t base = (int64_t(blockIdx.x) * blockDim.x * UNROLL) + threadIdx.x;
  uint4 buf[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    int64_t i = base + int64_t(u) * blockDim.x;
    if (i < n_vec) buf[u] = __ldcs(x + i);
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    int64_t i = base + int64_t(u) * blockDim.x;
    if (i < n_vec) {
      T* v = reinterpret_cast<T*>(&buf[u]);
#pragma unroll
      for (int k = 0; k < kPer; ++k) v[k] = relu1(v[k]);
      __stcs(y + i, buf[u]);
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
