// Helpers for an op's torch-facing binding (.cpp) on the LibTorch stable ABI: dtype mapping, checks,
// outputs, streams. Headers that parse in about a second, and a binary that loads in later torch
// versions (the builder passes -DTORCH_TARGET_VERSION). Everything here exists at torch 2.10.
#pragma once

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

// Including this header makes the file a stable-ABI binding: <opbuilder/library.h> registers through
// STABLE_TORCH_LIBRARY even where the builder's -DOPB_STABLE_ABI is missing (a hand-made compile).
#ifndef OPB_STABLE_ABI
#define OPB_STABLE_ABI
#endif
#include <opbuilder/dtype.h>
#include <opbuilder/huge_pages.h>
#include <opbuilder/library.h>

#ifdef OPB_WITH_CUDA
#include <cuda_runtime_api.h>

// torch's shim declares this under USE_CUDA only, which an extension does not define. It is part of
// the C shim since torch 2.3, exported by libtorch_cuda.
extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index,
                                                                              void** ret_stream);
#endif

namespace opb {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

// The launcher-side element type of `t`, or a RuntimeError naming the op and the argument.
inline DType dtype_of(const Tensor& t, const char* op, const char* arg) {
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

// "[4, 8]": a shape as torch prints it in error messages.
inline std::string shape_str(torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  std::string out = "[";
  for (size_t d = 0; d < sizes.size(); ++d) out += (d ? ", " : "") + std::to_string(sizes[d]);
  return out + "]";
}

// "cpu", "cuda:0": a tensor's device as torch prints it.
inline std::string device_str(const Tensor& t) {
  const torch::stable::Device d = t.device();
  std::string name;
  switch (d.type()) {
    case torch::headeronly::DeviceType::CPU: name = "cpu"; break;
    case torch::headeronly::DeviceType::CUDA: name = "cuda"; break;
    case torch::headeronly::DeviceType::Meta: name = "meta"; break;
    default: name = "device type " + std::to_string(static_cast<int>(d.type()));
  }
  return d.has_index() ? name + ":" + std::to_string(d.index()) : name;
}

inline bool same_device(const Tensor& a, const Tensor& b) { return a.device() == b.device(); }

inline bool same_shape(const Tensor& a, const Tensor& b) { return a.sizes().equals(b.sizes()); }


// A fresh contiguous tensor of `sizes` and `dtype` on like's device; on the CPU with the huge-page hint,
// which every large output written once wants. Made by the C shim's empty_strided, one ATen call:
// torch::stable::new_empty goes through torch_call_dispatcher, which looks the operator up by name and
// calls it boxed (0.7 us more a call on the 2-core CPU machine, the most of a 16-element op's time).
inline Tensor new_tensor(const Tensor& like, torch::headeronly::IntHeaderOnlyArrayRef sizes, ScalarType dtype) {
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  int64_t inline_strides[8];
  std::vector<int64_t> more_strides;
  int64_t* strides = inline_strides;
  if (ndim > 8) {
    more_strides.resize(ndim);
    strides = more_strides.data();
  }
  int64_t stride = 1;  // torch's contiguous strides: a dim of size 0 or 1 counts as 1
  for (int64_t d = ndim - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= sizes[d] > 1 ? sizes[d] : 1;
  }
  int32_t device_type = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  const int32_t code = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  AtenTensorHandle handle = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(ndim, sizes.data(), strides, code, device_type,
                                                  like.get_device_index(), &handle));
  Tensor t(handle);
  if (device_type == aoti_torch_device_type_cpu()) {
    advise_huge_pages(t.mutable_data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
  }
  return t;
}

// `t` itself when it is contiguous (the usual case, read without a dispatcher call), else a contiguous
// copy: what torch::stable::contiguous returns, which always goes through torch_call_dispatcher.
inline Tensor contiguous(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

// An op's output: contiguous, shaped and typed like `like`, on its device.
inline Tensor new_output(const Tensor& like) { return new_tensor(like, like.sizes(), like.scalar_type()); }

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

// Makes `t`'s device current while the returned guard lives (torch's allocator and our launches both
// follow it): `const auto guard = opb::device_guard(x);`. Where it is current already (the usual case),
// no guard is made: a stable DeviceGuard is a heap object made and freed through the C shim each call.
inline std::optional<torch::stable::accelerator::DeviceGuard> device_guard(const Tensor& t) {
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  const torch::stable::accelerator::DeviceIndex index = t.get_device_index();
  if (torch::stable::accelerator::getCurrentDeviceIndex() != index) guard.emplace(index);
  return guard;
}
#endif

}  // namespace opb
