// relu launcher: picks the vector or scalar path and the grid from the size.
#include "relu.cuh"
#include "relu_kernel.cuh"

namespace opb::relu {
namespace {

// Measured on an H200 (benchmarks/NOTES.md, fp32 32768x8192): 128 threads x 2 vectors with plain loads and
// stores ran at 0.99 of a device-to-device copy, against 0.92 for 256 x 4 with __ldcs/__stcs; the streaming
// hints cost 2-7% in every shape tried, and a persistent grid 3-8%.
constexpr int kThreads = 128;
constexpr int kUnroll = 2;
constexpr bool kStream = false;

template <typename T>
cudaError_t launch_typed(const T* x, T* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kPer = 16 / sizeof(T);
  const bool aligned = (reinterpret_cast<uintptr_t>(x) % 16 == 0) && (reinterpret_cast<uintptr_t>(y) % 16 == 0);
  int64_t n_vec = aligned ? n / kPer : 0;
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

}  // namespace

cudaError_t launch(const void* x, void* y, int64_t n, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::Float32:
      return launch_typed(static_cast<const float*>(x), static_cast<float*>(y), n, stream);
    case DType::Float16:
      return launch_typed(static_cast<const __half*>(x), static_cast<__half*>(y), n, stream);
    case DType::BFloat16:
      return launch_typed(static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), n, stream);
    case DType::Float64:
      return launch_typed(static_cast<const double*>(x), static_cast<double*>(y), n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace opb::relu
