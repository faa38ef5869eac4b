// How fused_add_rmsnorm's launchers cut a problem into blocks: shared by the forward and backward
// translation units (each compiles its own kernels; nvcc builds them in parallel).
#pragma once

#include <cstdint>

namespace opb::fused_add_rmsnorm::plan {

inline int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// The register ("rows") kernels' shape: tpr threads per row, nv packs per thread, threads per block.
struct Rows {
  bool ok = false;  // false: the row does not fit; use the loop kernels
  int nv = 1;
  int tpr = 1;
  int threads = 128;
  int rows_per_block() const { return threads / tpr; }
};

// nvec: 16-byte packs per row. max_nv, max_tpr: what the kernel can hold in registers.
//  * short rows (<= 32 packs): a power-of-two group of lanes per row, many rows per block;
//  * up to 32 * max_nv packs: a warp per row (no __syncthreads);
//  * longer: one row per block, ~128 threads with up to max_nv packs each, more threads as rows grow.
inline Rows rows_plan(int64_t nvec, int max_nv, int max_tpr, int short_threads) {
  Rows r;
  if (nvec <= 32) {
    r.nv = 1;
    r.tpr = next_pow2(nvec);
    r.threads = short_threads;
  } else if (nvec <= 32 * int64_t(max_nv)) {
    r.tpr = 32;
    r.nv = next_pow2(ceil_div(nvec, 32));
    r.threads = 128;
  } else {
    int nv = next_pow2(ceil_div(nvec, 128));
    r.nv = nv < max_nv ? nv : max_nv;
    r.tpr = static_cast<int>(round_up(ceil_div(nvec, r.nv), 32));
    r.threads = r.tpr;
    if (r.tpr > max_tpr) return r;
  }
  r.ok = true;
  return r;
}

// Threads of a loop kernel's block for `units` loads per row: about 8 per thread, 32..1024.
inline int loop_threads(int64_t units) {
  int64_t t = round_up(ceil_div(units, 8), 32);
  return static_cast<int>(t < 32 ? 32 : (t > 1024 ? 1024 : t));
}

}  // namespace opb::fused_add_rmsnorm::plan
