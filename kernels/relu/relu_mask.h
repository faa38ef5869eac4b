// The sign mask that relu's forward keeps for its backward: one bit per element, 0 where y <= 0 and 1
// elsewhere (NaN too: torch's threshold_backward passes the gradient through a NaN).
// Shared by the binding, the CPU kernel and the CUDA kernels; no torch headers.
//
// Layout, in 32-bit words: elements go in tiles of 32 * P, P = 16 / sizeof(element) (the elements of
// one 16-byte load); tile t has words t * P .. t * P + P - 1, and its element o sits at bit o / P of word
// o % P. On the GPU a warp loads a tile with one 16-byte load a lane, and word k is the warp's vote on
// the k-th element of every lane's load (__ballot_sync). The last tile's missing elements are 0 bits.
#pragma once

#include <cstdint>

namespace opb::relu {

// Elements a tile holds, and the mask's words, for n elements of `elem_size` bytes.
constexpr int64_t mask_tile(int64_t elem_size) { return 32 * (16 / elem_size); }
constexpr int64_t mask_words(int64_t n, int64_t elem_size) {
  return (n + mask_tile(elem_size) - 1) / mask_tile(elem_size) * (16 / elem_size);
}

}  // namespace opb::relu
