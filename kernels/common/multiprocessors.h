// The current CUDA device's multiprocessor count, read once per device: launchers size their grids by it.
// Host code only (the CUDA runtime API); no torch headers.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

namespace opb {

inline int multiprocessors() {
  static std::atomic<int> cache[64];
  int dev = 0;
  cudaGetDevice(&dev);
  const bool cached = dev >= 0 && dev < 64;
  if (cached) {
    const int n = cache[dev].load(std::memory_order_relaxed);
    if (n > 0) return n;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 1;
  if (cached) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace opb
