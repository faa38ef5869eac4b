// What softmax's launchers share: sizes in vectors, device facts, and a launch that can ask for a
// thread-block cluster. Host code for the .cu files; no torch headers.
#pragma once

#include <cuda_runtime.h>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "softmax.cuh"

namespace opb::softmax {

// Elements per vector: 16 bytes' worth when the rows are 16-byte aligned, else 1.
inline int vector_elems(const Problem& p) { return p.vectorized ? 16 / elem_bytes(p.dtype) : 1; }

// Vectors per row.
inline int64_t row_vectors(const Problem& p) { return p.cols / vector_elems(p); }

// Blocks per row of the split path.
inline int64_t split_count(const Plan& plan, const Problem& p) {
  const int64_t chunk = int64_t(plan.threads) * plan.vpt;
  return (row_vectors(p) + chunk - 1) / chunk;
}

struct DeviceInfo {
  int sms = 1;
  bool clusters = false;  // the device runs cluster launches and our kernels were built for sm_90+
};

// Asked once per device, then remembered. The device must be current.
DeviceInfo device_info(int device);

// kernel<<<blocks, threads, 0, stream>>>(args...), as clusters of `cluster` consecutive blocks when
// cluster > 1.
template <typename... KernelArgs, typename... Args>
cudaError_t launch(void (*kernel)(KernelArgs...), int64_t blocks, int threads, int cluster, cudaStream_t stream,
                   Args... args) {
  if (blocks <= 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  if (cluster <= 1) {
    kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(args...);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
}

// f(std::integral_constant<int, vpt>{}) for the vpt values the kernels are built for.
template <typename F>
cudaError_t with_vpt(int vpt, F&& f) {
  switch (vpt) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
  }
  return cudaErrorInvalidValue;
}

template <typename F>
cudaError_t with_warp_vpt(int vpt, F&& f) {
  switch (vpt) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
  }
  return cudaErrorInvalidValue;
}

// The split path's vectors per thread (one build of its kernels).
constexpr int kSplitVpt = 4;

}  // namespace opb::softmax
