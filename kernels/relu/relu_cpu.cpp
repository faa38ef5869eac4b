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

template <typename T>
void relu_typed(const T* x, T* y, int64_t n) {
  // 32K elements per task: large enough to amortise the thread pool, small enough to balance.
  torch::stable::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      // `x < 0` is false for NaN, so NaN passes through as torch.relu does.
      y[i] = x[i] < T(0) ? T(0) : x[i];
    }
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
#endif

// Element o of a tile sits at bit o / P of word o % P. Walked in memory order, o = l * P + k: the P words
// move together, one bit a step, which the compiler turns into vector operations on all P words at once.
// The last, partial tile takes a plain loop with bounds.
template <typename T>
void relu_mask_typed(const T* x, T* y, uint32_t* mask, int64_t n) {
  constexpr int P = 16 / sizeof(T);
  for_each_tile<T>(n, [&](int64_t t, int64_t base, int64_t m) {
    const T* xt = x + base;
    T* yt = y + base;
#ifdef __AVX2__
    if constexpr (std::is_same_v<T, float>) {
      if (m == mask_tile(sizeof(T))) return relu_mask_tile_avx2(xt, yt, mask + t * P);
    }
#endif
    uint32_t w[P] = {};
    if (m == mask_tile(sizeof(T))) {
      for (int l = 0; l < 32; ++l) {
        for (int k = 0; k < P; ++k) {
          const T v = xt[l * P + k];
          yt[l * P + k] = v < T(0) ? T(0) : v;
          w[k] |= uint32_t(!(v <= T(0))) << l;  // 1 for NaN, as torch's backward
        }
      }
    } else {
      for (int64_t o = 0; o < m; ++o) {
        yt[o] = xt[o] < T(0) ? T(0) : xt[o];
        w[o % P] |= uint32_t(!(xt[o] <= T(0))) << (o / P);
      }
    }
    std::copy(w, w + P, mask + t * P);
  });
}

template <typename T>
void relu_mask_backward_typed(const T* dy, const uint32_t* mask, T* dx, int64_t n) {
  constexpr int P = 16 / sizeof(T);
  constexpr int64_t kTile = mask_tile(sizeof(T));
  for_each_tile<T>(n, [&](int64_t t, int64_t base, int64_t m) {
    const T* g = dy + base;
    T* out = dx + base;
    const uint32_t* w = mask + t * P;
#ifdef __AVX2__
    if constexpr (std::is_same_v<T, float>) {
      if (m == kTile) return relu_mask_backward_tile_avx2(g, w, out);
    }
#endif
    if (m == kTile) {
      // As bits: keep all of an element's bits or none, +0 where the mask's bit is 0. Each bit is read
      // with its own shift (w[k] >> l), not by shifting w[k] a step at a time: the compiler vectorizes
      // this form (4x faster on an AVX-512 CPU, 1M floats: 115 against 447 us, as fast as a copy).
      // The elements are read and written as unsigned integers of their size (may_alias: no aliasing rule is broken).
      using U = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
      typedef U __attribute__((may_alias)) AU;
      const AU* gb = reinterpret_cast<const AU*>(g);
      AU* ob = reinterpret_cast<AU*>(out);
      for (int l = 0; l < 32; ++l) {
        for (int k = 0; k < P; ++k) ob[l * P + k] = gb[l * P + k] & (U(0) - U((w[k] >> l) & 1u));
      }
    } else {
      for (int64_t o = 0; o < m; ++o) out[o] = (w[o % P] >> (o / P)) & 1u ? g[o] : T(0);
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
