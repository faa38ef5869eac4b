// relu on the CPU: y = max(x, 0), NaN kept. Contiguous buffers; chunks run in parallel.
#include "relu_cpu.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "relu_mask.h"

namespace opb::relu {

using torch::headeronly::BFloat16;
using torch::headeronly::Half;
namespace {

// The decisions on an element's bits, as unsigned integers of its size (no float arithmetic: the compiler
// vectorizes these loops for every type, where a float16 or bfloat16 compare converts each element in scalar
// code: 25-45x slower than torch.relu on 1M elements). kSign: the sign bit; kInf: +inf's bits.
// The element's unsigned type U of its size; the sign bit is U's top bit.
template <typename Unsigned, Unsigned Inf>
struct BitsOf {
  using U = Unsigned;
  typedef U __attribute__((may_alias)) A;
  static constexpr U kSign = U(1) << (8 * sizeof(U) - 1), kInf = Inf;
};
template <typename T>
struct Bits;
template <>
struct Bits<float> : BitsOf<uint32_t, 0x7F800000u> {};
template <>
struct Bits<double> : BitsOf<uint64_t, 0x7FF0000000000000ull> {};
template <>
struct Bits<BFloat16> : BitsOf<uint16_t, 0x7F80u> {};
template <>
struct Bits<Half> : BitsOf<uint16_t, 0x7C00u> {};

// An element read or written as its bits (A: may_alias, so no aliasing rule is broken).
template <typename T>
using AliasBits = typename Bits<T>::A;

// relu on the bits: +0 for a negative number (-inf too), the element itself otherwise: -0.0 and a NaN of
// either sign kept bit for bit, as torch.relu (x < 0 ? 0 : x).
template <typename T, typename U = typename Bits<T>::U>
inline U relu_bits(U u) {
  const bool negative = (u > Bits<T>::kSign) & (U(u & ~Bits<T>::kSign) <= Bits<T>::kInf);  // no branch
  return negative ? U(0) : u;
}

// The mask's bit, !(x <= 0): 1 for a positive number (+inf too) and a NaN of either sign, 0 for +-0 and
// the negatives.
template <typename T, typename U = typename Bits<T>::U>
inline uint32_t keep_bit(U u) {
  return uint32_t(U(u - 1) < U(Bits<T>::kSign - 1)) | uint32_t(U(u & ~Bits<T>::kSign) > Bits<T>::kInf);
}

template <typename T>
void relu_typed(const T* x, T* y, int64_t n) {
  // 32K elements per task: large enough to amortise the thread pool, small enough to balance.
  torch::stable::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    // Local pointers: a may_alias store could change the captured ones, which the loop would then reload.
    const AliasBits<T>* in = reinterpret_cast<const AliasBits<T>*>(x) + begin;
    AliasBits<T>* out = reinterpret_cast<AliasBits<T>*>(y) + begin;
    for (int64_t i = 0; i < end - begin; ++i) out[i] = relu_bits<T>(in[i]);
  });
}

// Calls f(t, base, m) for every tile t of the mask's layout (relu_mask.h): elements base .. base + m - 1,
// m = the tile's size but in the last tile. Tiles run in parallel, about 32K elements a task.
template <typename T, typename F>
void for_each_tile(int64_t n, const F& f) {
  constexpr int64_t kTile = mask_tile(sizeof(T));
  torch::stable::parallel_for(0, (n + kTile - 1) / kTile, 32768 / kTile, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) f(t, t * kTile, std::min(kTile, n - t * kTile));
  });
}

#ifdef __AVX2__
// Where the build targets an AVX2 CPU (-march=native, the default: OPB_CPU_ARCH; the portable prebuilt takes
// the loops below). One full float tile (32 rows of 4), two rows a vector: lane i of vector j holds row 2j + i / 4 of
// word i % 4. y = max(0, x) keeps NaN (the second operand is returned for a NaN) and -0.0, as the loop below;
// a lane's bit is set where !(x <= 0), NaN included, and lands on bit 2j or 2j + 1 of its lane's word; the
// two halves of the lane words are ORed at the end. The plain loop below ran at a third of torch.relu's speed
// here (one row, 4 lanes: half an AVX2 register; GCC made no better of wider rows).
inline void relu_mask_tile_avx2(const float* x, float* y, uint32_t* w) {
  const __m256 zero = _mm256_setzero_ps();
  __m256i bit = _mm256_setr_epi32(1, 1, 1, 1, 2, 2, 2, 2);
  __m256i words = _mm256_setzero_si256();
  for (int j = 0; j < 16; ++j) {
    const __m256 v = _mm256_loadu_ps(x + 8 * j);
    _mm256_storeu_ps(y + 8 * j, _mm256_max_ps(zero, v));
    const __m256i keep = _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_NLE_UQ));
    words = _mm256_or_si256(words, _mm256_and_si256(keep, bit));
    bit = _mm256_slli_epi32(bit, 2);
  }
  const __m128i both = _mm_or_si128(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(w), both);
}

// Its backward, lane for lane: the tile's 4 words in both halves of a register, each lane's bit picked with the
// same bit pattern; an element's gradient is kept whole where its bit is set, +0 where not.
inline void relu_mask_backward_tile_avx2(const float* g, const uint32_t* w, float* out) {
  const __m128i w4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m256i words = _mm256_set_m128i(w4, w4);
  __m256i bit = _mm256_setr_epi32(1, 1, 1, 1, 2, 2, 2, 2);
  for (int j = 0; j < 16; ++j) {
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_and_si256(words, bit), bit);
    _mm256_storeu_ps(out + 8 * j, _mm256_and_ps(_mm256_loadu_ps(g + 8 * j), _mm256_castsi256_ps(keep)));
    bit = _mm256_slli_epi32(bit, 2);
  }
}

// A full float16 or bfloat16 tile (32 rows of 8), one row a step, on the bits as 16-bit integers (relu_bits and
// keep_bit): the row's 8 elements in one 16-byte register, their keep bits widened to the 8 words' lanes.
template <typename T>
inline void relu_mask_tile16_avx2(const uint16_t* x, uint16_t* y, uint32_t* w) {
  const __m128i zero = _mm_setzero_si128();
  const __m128i magnitude = _mm_set1_epi16(0x7FFF);
  const __m128i inf = _mm_set1_epi16(static_cast<int16_t>(Bits<T>::kInf));
  __m256i bit = _mm256_set1_epi32(1);
  __m256i words = _mm256_setzero_si256();
  for (int l = 0; l < 32; ++l) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * l));
    const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(v, magnitude), inf);  // |bits| <= 0x7FFF: signed compare
    const __m128i nonzero = _mm_cmpgt_epi16(_mm_and_si128(v, magnitude), zero);
    // As int16, v < 0 is a set sign; v > 0 a clear sign and a nonzero magnitude (+inf and +NaN too).
    const __m128i negative = _mm_andnot_si128(nan, _mm_and_si128(_mm_cmplt_epi16(v, zero), nonzero));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 8 * l), _mm_andnot_si128(negative, v));
    const __m128i keep = _mm_or_si128(nan, _mm_cmpgt_epi16(v, zero));
    words = _mm256_or_si256(words, _mm256_and_si256(_mm256_cvtepi16_epi32(keep), bit));
    bit = _mm256_slli_epi32(bit, 1);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), words);
}

// Its backward: row l's 8 bits picked from the 8 words, narrowed to 16-bit lanes (all ones or zero).
inline void relu_mask_backward_tile16_avx2(const uint16_t* g, const uint32_t* w, uint16_t* out) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  __m256i bit = _mm256_set1_epi32(1);
  for (int l = 0; l < 32; ++l) {
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_and_si256(words, bit), bit);
    const __m128i keep16 = _mm_packs_epi32(_mm256_castsi256_si128(keep), _mm256_extracti128_si256(keep, 1));
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 8 * l));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * l), _mm_and_si128(v, keep16));
    bit = _mm256_slli_epi32(bit, 1);
  }
}
#endif

// Element o of a tile sits at bit o / P of word o % P. Walked in memory order, o = l * P + k: the P words
// move together, one bit a step. The last, partial tile takes a plain loop with bounds.
template <typename T>
void relu_mask_typed(const T* x, T* y, uint32_t* mask, int64_t n) {
  constexpr int P = 16 / sizeof(T);
  const AliasBits<T>* xb = reinterpret_cast<const AliasBits<T>*>(x);
  AliasBits<T>* yb = reinterpret_cast<AliasBits<T>*>(y);
  for_each_tile<T>(n, [&](int64_t t, int64_t base, int64_t m) {
    const AliasBits<T>* xt = xb + base;
    AliasBits<T>* yt = yb + base;
#ifdef __AVX2__
    if (m == mask_tile(sizeof(T))) {
      if constexpr (std::is_same_v<T, float>) {
        return relu_mask_tile_avx2(reinterpret_cast<const float*>(x) + base, reinterpret_cast<float*>(y) + base,
                                   mask + t * P);
      } else if constexpr (sizeof(T) == 2) {
        return relu_mask_tile16_avx2<T>(xt, yt, mask + t * P);
      }
    }
#endif
    uint32_t w[P] = {};
    if (m == mask_tile(sizeof(T))) {
      // Two passes over the tile (in cache): the words stay in registers only where no store of y, which may
      // alias anything, comes between their updates.
      for (int l = 0; l < 32; ++l) {
        for (int k = 0; k < P; ++k) w[k] |= keep_bit<T>(xt[l * P + k]) << l;
      }
      for (int64_t o = 0; o < m; ++o) yt[o] = relu_bits<T>(xt[o]);
    } else {
      for (int64_t o = 0; o < m; ++o) {
        yt[o] = relu_bits<T>(xt[o]);
        w[o % P] |= keep_bit<T>(xt[o]) << (o / P);
      }
    }
    std::copy(w, w + P, mask + t * P);
  });
}

template <typename T>
void relu_mask_backward_typed(const T* dy, const uint32_t* mask, T* dx, int64_t n) {
  constexpr int P = 16 / sizeof(T);
  constexpr int64_t kTile = mask_tile(sizeof(T));
  using U = typename Bits<T>::U;
  // The gradients as bits: kept whole where the mask's bit is 1, +0 where it is 0 (a NaN gradient too).
  const AliasBits<T>* gb = reinterpret_cast<const AliasBits<T>*>(dy);
  AliasBits<T>* ob = reinterpret_cast<AliasBits<T>*>(dx);
  for_each_tile<T>(n, [&](int64_t t, int64_t base, int64_t m) {
    const AliasBits<T>* g = gb + base;
    AliasBits<T>* out = ob + base;
    uint32_t w[P];  // a copy: the stores of dx may alias the mask, whose words would then be read again
    std::copy(mask + t * P, mask + t * P + P, w);
#ifdef __AVX2__
    if (m == kTile) {
      if constexpr (std::is_same_v<T, float>) {
        return relu_mask_backward_tile_avx2(reinterpret_cast<const float*>(dy) + base,  w,
                                            reinterpret_cast<float*>(dx) + base);
      } else if constexpr (sizeof(T) == 2) {
        return relu_mask_backward_tile16_avx2(g, w, out);
      }
    }
#endif
    if (m == kTile) {
      // Each bit read with its own shift (w[k] >> l), not by shifting w[k] a step at a time: the compiler
      // vectorizes this form (4x faster on an AVX-512 CPU, 1M floats: 115 against 447 us, as fast as a copy).
      for (int l = 0; l < 32; ++l) {
        for (int k = 0; k < P; ++k) out[l * P + k] = g[l * P + k] & (U(0) - U((w[k] >> l) & 1u));
      }
    } else {
      for (int64_t o = 0; o < m; ++o) out[o] = g[o] & (U(0) - U((w[o % P] >> (o / P)) & 1u));
    }
  });
}

// f(T{}) for the element type of `dtype`.
template <typename F>
void with_type(DType dtype, const F& f) {
  switch (dtype) {
    case DType::Float32: return f(float{});
    case DType::Float16: return f(Half{});
    case DType::BFloat16: return f(BFloat16{});
    case DType::Float64: return f(double{});
  }
}

}  // namespace

void relu_cpu(const void* x, void* y, int64_t n, DType dtype) {
  with_type(dtype, [&](auto v) {
    using T = decltype(v);
    relu_typed(static_cast<const T*>(x), static_cast<T*>(y), n);
  });
}

void relu_mask_cpu(const void* x, void* y, void* mask, int64_t n, DType dtype) {
  with_type(dtype, [&](auto v) {
    using T = decltype(v);
    relu_mask_typed(static_cast<const T*>(x), static_cast<T*>(y), static_cast<uint32_t*>(mask), n);
  });
}

void relu_mask_backward_cpu(const void* dy, const void* mask, void* dx, int64_t n, DType dtype) {
  with_type(dtype, [&](auto v) {
    using T = decltype(v);
    relu_mask_backward_typed(static_cast<const T*>(dy), static_cast<const uint32_t*>(mask), static_cast<T*>(dx), n);
  });
}

}  // namespace opb::relu
