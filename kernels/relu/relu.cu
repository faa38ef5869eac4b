// relu launcher: picks the vector or scalar path and the grid from the size.
#include "relu.cuh"

#include <algorithm>
#include <cstdint>

#include "relu_kernel.cuh"
#include "relu_mask.h"
#include "relu_mask_kernel.cuh"

namespace opb::relu {
namespace {

// Measured on an H200 (benchmarks/NOTES.md, fp32 32768x8192): 128 threads x 2 vectors with plain loads and
// stores ran at 0.99 of a device-to-device copy, against 0.92 for 256 x 4 with __ldcs/__stcs; the streaming
// hints cost 2-7% in every shape tried, and a persistent grid 3-8%.
constexpr int kThreads = 128;
constexpr int kUnroll = 2;
constexpr bool kStream = false;

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
cudaError_t launch_typed(const T* x, T* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kPer = 16 / sizeof(T);
  int64_t n_vec = aligned16(x) && aligned16(y) ? n / kPer : 0;
  if (n_vec > 0) {
    int64_t blocks = (n_vec + int64_t(kThreads) * kUnroll - 1) / (int64_t(kThreads) * kUnroll);
    relu_vec_kernel<T, kThreads, kUnroll, kStream><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        reinterpret_cast<const uint4*>(x), reinterpret_cast<uint4*>(y), n_vec);
  }
  int64_t done = n_vec * kPer;
  int64_t rest = n - done;
  if (rest > 0) {
    int64_t blocks = (rest + kThreads - 1) / kThreads;
    if (blocks > 65535) blocks = 65535;
    relu_scalar_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x + done, y + done, rest);
  }
  return cudaGetLastError();
}

// A warp a tile of 32 x 16 bytes, kUnroll tiles a warp, kThreads threads: the shape of the plain relu above.
inline unsigned mask_blocks(int64_t tiles) {
  const int64_t per_block = int64_t(kThreads / 32) * kUnroll;
  return static_cast<unsigned>(std::min<int64_t>((tiles + per_block - 1) / per_block, int64_t(1) << 30));
}

template <typename T>
cudaError_t launch_mask_typed(const T* x, T* y, uint32_t* mask, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t tiles = (n + mask_tile(sizeof(T)) - 1) / mask_tile(sizeof(T));
  if (aligned16(x) && aligned16(y)) {
    relu_mask_kernel<T, true, kUnroll><<<mask_blocks(tiles), kThreads, 0, stream>>>(x, y, mask, n, tiles);
  } else {
    relu_mask_kernel<T, false, kUnroll><<<mask_blocks(tiles), kThreads, 0, stream>>>(x, y, mask, n, tiles);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_mask_backward_typed(const T* dy, const uint32_t* mask, T* dx, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t tiles = (n + mask_tile(sizeof(T)) - 1) / mask_tile(sizeof(T));
  if (aligned16(dy) && aligned16(dx)) {
    relu_mask_backward_kernel<T, true, kUnroll><<<mask_blocks(tiles), kThreads, 0, stream>>>(dy, mask, dx, n, tiles);
  } else {
    relu_mask_backward_kernel<T, false, kUnroll><<<mask_blocks(tiles), kThreads, 0, stream>>>(dy, mask, dx, n, tiles);
  }
  return cudaGetLastError();
}

// f(T{}) for the element type of `dtype`.
template <typename F>
cudaError_t with_type(DType dtype, const F& f) {
  switch (dtype) {
    case DType::Float32: return f(float{});
    case DType::Float16: return f(__half{});
    case DType::BFloat16: return f(__nv_bfloat16{});
    case DType::Float64: return f(double{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch(const void* x, void* y, int64_t n, DType dtype, cudaStream_t stream) {
  return with_type(dtype, [&](auto v) {
    using T = decltype(v);
    return launch_typed(static_cast<const T*>(x), static_cast<T*>(y), n, stream);
  });
}

cudaError_t launch_mask(const void* x, void* y, void* mask, int64_t n, DType dtype, cudaStream_t stream) {
  return with_type(dtype, [&](auto v) {
    using T = decltype(v);
    return launch_mask_typed(static_cast<const T*>(x), static_cast<T*>(y), static_cast<uint32_t*>(mask), n, stream);
  });
}

cudaError_t launch_mask_backward(const void* dy, const void* mask, void* dx, int64_t n, DType dtype,
                                 cudaStream_t stream) {
  return with_type(dtype, [&](auto v) {
    using T = decltype(v);
    return launch_mask_backward_typed(static_cast<const T*>(dy), static_cast<const uint32_t*>(mask),
                                      static_cast<T*>(dx), n, stream);
  });
}

}  // namespace opb::relu
