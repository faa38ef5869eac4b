// Element types on the GPU: the accumulation type of each storage type, and explicit conversions.
//
// torch.utils.cpp_extension compiles with -D__CUDA_NO_HALF_CONVERSIONS__ and friends, so half and
// bfloat16 convert through these functions, never implicitly. Device code only; no torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "common/acc_type.h"

namespace opb {

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
// bf16 -> fp32 is exact: the bits, shifted. Plain integer arithmetic, which the compiler may redo
// instead of keeping a float copy of every element alive in registers.
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) {
  unsigned short bits;
  memcpy(&bits, &v, sizeof(bits));
  return __uint_as_float(static_cast<unsigned>(bits) << 16);
}

// Round to nearest even, as torch's own casts do.
template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> v);
template <>
__device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <>
__device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// out[0], out[1] = a, b converted: 16-bit types convert as a pair, one instruction for two on sm_80+
// (the same rounding as from_acc). `out` must be 4-byte aligned for them.
template <typename T>
__device__ __forceinline__ void from_acc2(acc_t<T> a, acc_t<T> b, T* out) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
    memcpy(out, &r, sizeof(r));
  } else if constexpr (std::is_same_v<T, __half>) {
    const __half2 r = __floats2half2_rn(a, b);
    memcpy(out, &r, sizeof(r));
  } else {
    out[0] = from_acc<T>(a);
    out[1] = from_acc<T>(b);
  }
}

}  // namespace opb
