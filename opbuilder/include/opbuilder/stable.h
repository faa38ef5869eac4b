// TEMP stand-in for the stable-ABI binding helpers (the real header replaces this file).
// Everything here exists at TORCH_TARGET_VERSION 2.10.
#pragma once

#ifdef OPB_WITH_CUDA
// aoti_torch_get_current_cuda_stream is declared only under USE_CUDA, which cpp_extension does not pass.
#ifndef USE_CUDA
#define USE_CUDA
#endif
#include <cuda_runtime_api.h>
#endif

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <opbuilder/dtype.h>
#include <opbuilder/library.h>

namespace opb {

using Tensor = torch::stable::Tensor;

// The launcher-side element type of `t`, or a RuntimeError naming the op and the argument.
inline DType dtype_of(const Tensor& t, const char* op, const char* arg) {
  using torch::headeronly::ScalarType;
  switch (t.scalar_type()) {
    case ScalarType::Float: return DType::Float32;
    case ScalarType::Half: return DType::Float16;
    case ScalarType::BFloat16: return DType::BFloat16;
    case ScalarType::Double: return DType::Float64;
    default:
      STD_TORCH_CHECK(false, op, ": ", arg, " must be float32, float16, bfloat16 or float64, got ", t.scalar_type());
  }
  return DType::Float32;  // not reached
}

// An op's output: contiguous, shaped and typed like `like`, on its device; on the CPU backed by
// transparent huge pages before its first write (a hint: errors are ignored).
inline Tensor new_output(const Tensor& like) {
  Tensor t = torch::stable::new_empty(like, like.sizes());
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (t.is_cpu() && bytes >= 2 * kHuge) {
    const uintptr_t data = reinterpret_cast<uintptr_t>(t.mutable_data_ptr());
    const uintptr_t begin = (data + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t end = (data + bytes) & ~(kHuge - 1);
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#endif
  return t;
}

#ifdef OPB_WITH_CUDA
// The stream torch is using on `t`'s device: kernels launched on it order with torch's own work.
inline cudaStream_t stream_of(const Tensor& t) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
  return static_cast<cudaStream_t>(stream);
}

inline void check_launch(cudaError_t err, const char* op) {
  STD_TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}
#endif

}  // namespace opb
