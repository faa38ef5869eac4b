// Rows of float16 and bfloat16 to float and back on the CPU, many elements at a time. Half's and BFloat16's own
// conversions go one element at a time (Half's through a routine of branches on the bits; BFloat16's rounding
// tests for NaN with a branch), so a kernel loop that converts as it computes does not vectorize: float16
// fused_relu_layernorm took 5x torch's time, bfloat16 fused_add_rmsnorm 7x its own float32 time. A kernel
// converts a row into a float buffer, computes on floats, and converts the result back (where that measures
// faster: fused_relu_layernorm's bfloat16 loops vectorize as they are). Both directions give the bits Half's
// and BFloat16's own conversions give (round to nearest even; a NaN stays a NaN, its payload aside).
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace opb::cpu_rows {

using torch::headeronly::BFloat16;
using torch::headeronly::Half;

// Whether a kernel computes on T through a float row buffer.
template <typename T>
constexpr bool kThroughFloat = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

// dst[0..n) = src[0..n) as floats.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  static_assert(kThroughFloat<T>);
  int64_t j = 0;
  if constexpr (std::is_same_v<T, BFloat16>) {
    // A bfloat16 is a float's upper half.
    for (; j < n; ++j) {
      uint16_t h;
      std::memcpy(&h, src + j, sizeof h);
      const uint32_t bits = uint32_t(h) << 16;
      std::memcpy(dst + j, &bits, sizeof bits);
    }
  } else {
#ifdef __F16C__
    for (; j + 8 <= n; j += 8) {
      _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
    }
#endif
    for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
  }
}

// dst[0..n) = src[0..n) rounded to T.
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  static_assert(kThroughFloat<T>);
  int64_t j = 0;
  if constexpr (std::is_same_v<T, BFloat16>) {
    // Round to nearest even; a NaN becomes the quiet NaN 0x7fc0, as BFloat16's own conversion does.
    for (; j < n; ++j) {
      uint32_t bits;
      std::memcpy(&bits, src + j, sizeof bits);
      const uint32_t rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
      const uint16_t h = (bits & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(rounded);
      std::memcpy(dst + j, &h, sizeof h);
    }
  } else {
#ifdef __F16C__
    for (; j + 8 <= n; j += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; j < n; ++j) dst[j] = static_cast<Half>(src[j]);
  }
}

}  // namespace opb::cpu_rows
