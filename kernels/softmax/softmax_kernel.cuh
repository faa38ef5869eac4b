// softmax on the GPU, forward and backward, over the last dim of a contiguous [rows, cols] buffer.
// Device code only; no torch headers.
//
// Every path keeps the part of a row it owns in registers, so x (or y and grad_y) is read from global
// memory once:
//   warp path   one row per group of 1..32 lanes (short rows); reductions are shuffles.
//   block path  one row per block (up to 1024 threads), or per thread-block cluster of up to 8 blocks
//               on sm_90 (the row is split across the cluster's blocks and the partial results meet
//               in distributed shared memory), so rows up to 8 x 1024 x 8 vectors stay on chip.
//   split path  rows longer than that, or too few of them to fill the device: kernel 1 writes one
//               partial result per chunk of a row to a workspace; kernel 2 reloads its chunk (from L2
//               where it is still there), merges the row's partials and writes. x is read twice.
//
// Forward partials are (max, sum of exp(x - max)) pairs, merged the online-softmax way; backward
// partials are sums of y * grad_y. Accumulation is in float (double for double inputs). A row held by
// one block of few elements a thread may instead take forward_block_once_kernel: the row's max first,
// then exp(x - max) once an element, kept, summed and scaled (two reductions, half the exps).
//
// Access pattern: a thread's v-th access of a row is vector number base + v * stride + lane, where a
// vector is N consecutive elements (16 bytes when the rows are 16-byte aligned, else 1 element), so a
// warp's loads are contiguous.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>

#include "common/cuda_types.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#define OPB_SOFTMAX_CLUSTERS 1
#endif

namespace opb::softmax {

// ---- element types -------------------------------------------------------------------------------

using opb::AccOf;
using opb::from_acc;
using opb::from_acc2;
using opb::to_acc;

template <typename Acc>
__device__ __forceinline__ Acc neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <>
__device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

// exp(a): one MUFU op (2 ulp; -inf gives 0). exp2f would add range handling around it to keep subnormal
// results, which costs three more instructions an element; here a result below 2^-126 flushes to 0.
__device__ __forceinline__ float exp_acc(float a) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a * 1.4426950408889634f));
  return r;
}
__device__ __forceinline__ double exp_acc(double a) { return exp(a); }

// max that keeps NaN (fmaxf drops it): a row holding NaN gives NaN everywhere, as torch does.
template <typename Acc>
__device__ __forceinline__ Acc max_nan(Acc a, Acc b) {
  return (a > b || a != a) ? a : b;
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <>
__device__ __forceinline__ float max_nan<float>(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
#endif

// ---- vectors of N elements -----------------------------------------------------------------------

template <int Bytes>
struct RawOf;
template <>
struct RawOf<2> {
  using type = unsigned short;
};
template <>
struct RawOf<4> {
  using type = unsigned int;
};
template <>
struct RawOf<8> {
  using type = uint2;
};
template <>
struct RawOf<16> {
  using type = uint4;
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Cache policies of a kernel's global loads and stores (compile-time knobs, so the tuning script can time
// them side by side; benchmarks/NOTES.md has the measurements behind each kernel's defaults).
//   Ld::Nc  ld.global.nc (read-only path; what a plain load of const __restrict__ data compiles to)
//   Ld::Ca  ld.global.ca (cache at all levels)
//   Ld::Cs  ld.global.cs (evict first: data read once)
//   St::Wb  st.global.wb (a plain store)
//   St::Cs  st.global.cs (evict first)
enum class Ld : int { Nc = 0, Ca = 1, Cs = 2 };
enum class St : int { Wb = 0, Cs = 1 };

template <Ld L, typename R>
__device__ __forceinline__ R load_raw(const R* p) {
  if constexpr (L == Ld::Cs) return __ldcs(p);
  else if constexpr (L == Ld::Ca) return __ldca(p);
  else return __ldg(p);
}

template <Ld L, typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  using R = typename RawOf<sizeof(T) * N>::type;
  R r = load_raw<L>(reinterpret_cast<const R*>(p));
  Pack<T, N> out;
  memcpy(&out, &r, sizeof(R));
  return out;
}

template <St S, typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  using R = typename RawOf<sizeof(T) * N>::type;
  R r;
  memcpy(&r, &v, sizeof(R));
  if constexpr (S == St::Cs)
    __stcs(reinterpret_cast<R*>(p), r);
  else
    __stwb(reinterpret_cast<R*>(p), r);  // a plain store, kept as one access (a struct copy may be split)
}

// Two 16-bit elements side by side, for compares that take a pair at once.
template <typename T>
struct PairOf;
template <>
struct PairOf<__half> {
  using type = __half2;
  __device__ __forceinline__ static type neg_inf() {
    return __halves2half2(__ushort_as_half(0xfc00), __ushort_as_half(0xfc00));
  }
};
template <>
struct PairOf<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ __forceinline__ static type neg_inf() {
    return __halves2bfloat162(__ushort_as_bfloat16(0xff80), __ushort_as_bfloat16(0xff80));
  }
};

// ---- partial results and how they merge ------------------------------------------------------------

// Forward: the max m of some elements and the sum of exp(x - m) over them. (-inf, 0) is the identity:
// elements that are all -inf contribute nothing until the whole row turns out to be -inf, and then
// exp(-inf - -inf) = NaN at the end gives torch's NaN row.
template <typename Acc>
struct MaxSum {
  Acc m, s;

  __device__ __forceinline__ static MaxSum identity() { return {neg_inf<Acc>(), Acc(0)}; }

  // The same bits in either argument order, so every lane of a butterfly reduction ends with the same
  // (max, sum). One exp: the pair with the larger max (or a NaN max) keeps its sum as it is.
  __device__ __forceinline__ static MaxSum merge(MaxSum a, MaxSum b) {
    // Equal maxima (both -inf included, where the general formula would make 0 * NaN): add.
    if (a.m == b.m) return {a.m, a.s + b.s};
    const bool a_wins = a.m > b.m || a.m != a.m;
    const MaxSum hi = a_wins ? a : b;
    const MaxSum lo = a_wins ? b : a;
    return {hi.m, hi.s + lo.s * exp_acc(lo.m - hi.m)};
  }

  __device__ __forceinline__ MaxSum shfl_xor(int offset, int width) const {
    return {__shfl_xor_sync(0xffffffffu, m, offset, width), __shfl_xor_sync(0xffffffffu, s, offset, width)};
  }
};

// Backward: a sum of y * grad_y.
template <typename Acc>
struct Sum {
  Acc s;

  __device__ __forceinline__ static Sum identity() { return {Acc(0)}; }
  __device__ __forceinline__ static Sum merge(Sum a, Sum b) { return {a.s + b.s}; }
  __device__ __forceinline__ Sum shfl_xor(int offset, int width) const {
    return {__shfl_xor_sync(0xffffffffu, s, offset, width)};
  }
};

// All lanes of each aligned group of `width` lanes end with the group's merge (butterfly; the merges
// are commutative bit for bit, so every lane holds the same value).
template <typename P>
__device__ __forceinline__ P group_allreduce(P p, int width) {
  for (int offset = width >> 1; offset > 0; offset >>= 1) p = P::merge(p, p.shfl_xor(offset, width));
  return p;
}

// Every thread of the block ends with the block's merge. One __syncthreads: each warp reduces the
// per-warp results itself. `scratch` holds 32 entries and is written once per block lifetime.
template <typename P>
__device__ __forceinline__ P block_allreduce(P p, P* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  p = group_allreduce(p, 32);
  if (lane == 0) scratch[warp] = p;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  p = lane < warps ? scratch[lane] : P::identity();
  return group_allreduce(p, 32);
}

// The blocks of a cluster (one row split across them) exchange their block results through
// distributed shared memory. Returns the row's merge; `done_reading()` must follow once no thread
// reads a peer's shared memory any more and `wait_peers()` before the block exits, so no block
// leaves while a peer may still read its slot.
struct Cluster {
  unsigned rank = 0;
  unsigned size = 1;

  __device__ __forceinline__ static Cluster current() {
    Cluster c;
#ifdef OPB_SOFTMAX_CLUSTERS
    cooperative_groups::cluster_group g = cooperative_groups::this_cluster();
    c.rank = g.block_rank();
    c.size = g.num_blocks();
#endif
    return c;
  }

  template <typename P>
  __device__ __forceinline__ P allreduce(P p, P* slot) const {
#ifdef OPB_SOFTMAX_CLUSTERS
    if (size > 1) {
      cooperative_groups::cluster_group g = cooperative_groups::this_cluster();
      if (threadIdx.x == 0) *slot = p;
      g.sync();  // release/acquire at cluster scope: every block's slot is visible
      const unsigned lane = threadIdx.x & 31;
      P q = lane < size ? *g.map_shared_rank(slot, lane) : P::identity();
      p = group_allreduce(q, 32);
    }
#endif
    return p;
  }

  __device__ __forceinline__ void done_reading() const {
#ifdef OPB_SOFTMAX_CLUSTERS
    if (size > 1) asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
  }

  __device__ __forceinline__ void wait_peers() const {
#ifdef OPB_SOFTMAX_CLUSTERS
    if (size > 1) asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
  }
};

// ---- one thread's share of a row -------------------------------------------------------------------

// A thread's VPT vectors of a row: vector index base + v * stride, valid below `count`.
template <typename T, int N, int VPT>
struct Slice {
  Pack<T, N> buf[VPT];
  int64_t base;
  int64_t stride;
  int64_t count;

  __device__ __forceinline__ bool valid(int v) const { return base + v * stride < count; }
  __device__ __forceinline__ int64_t elem(int v) const { return (base + v * stride) * N; }

  template <Ld L>
  __device__ __forceinline__ void load(const T* row) {
#pragma unroll
    for (int v = 0; v < VPT; ++v)
      if (valid(v)) buf[v] = load_pack<L, T, N>(row + elem(v));
  }
};

// The largest element of a thread's slice, NaN if one is NaN. 16-bit elements are compared two at a
// time in their own type (exact: widening keeps order) and widened once at the end.
template <typename T, int N, int VPT, typename Acc = typename AccOf<T>::type>
__device__ __forceinline__ Acc max_of(const Slice<T, N, VPT>& x) {
  if constexpr (sizeof(T) == 2 && N % 2 == 0) {
    using T2 = typename PairOf<T>::type;
    T2 m = PairOf<T>::neg_inf();
#pragma unroll
    for (int v = 0; v < VPT; ++v)
      if (x.valid(v)) {
        const T2* pairs = reinterpret_cast<const T2*>(x.buf[v].v);
#pragma unroll
        for (int k = 0; k < N / 2; ++k) m = __hmax2_nan(m, pairs[k]);
      }
    return max_nan(to_acc(m.x), to_acc(m.y));
  } else {
    Acc m = neg_inf<Acc>();
#pragma unroll
    for (int v = 0; v < VPT; ++v)
      if (x.valid(v)) {
#pragma unroll
        for (int k = 0; k < N; ++k) m = max_nan(m, to_acc(x.buf[v].v[k]));
      }
    return m;
  }
}

template <typename T, int N, int VPT, typename Acc = typename AccOf<T>::type>
__device__ __forceinline__ MaxSum<Acc> max_sum_of(const Slice<T, N, VPT>& x) {
  const Acc m = max_of(x);
  Acc s = 0;
  if (m != neg_inf<Acc>()) {
#pragma unroll
    for (int v = 0; v < VPT; ++v)
      if (x.valid(v)) {
#pragma unroll
        for (int k = 0; k < N; ++k) s += exp_acc(to_acc(x.buf[v].v[k]) - m);
      }
  }
  return {m, s};
}

// y = exp(x - m) / s. For an all -inf row m = -inf and this is NaN, as torch gives.
template <St S, typename T, int N, int VPT, typename Acc = typename AccOf<T>::type>
__device__ __forceinline__ void write_softmax(const Slice<T, N, VPT>& x, MaxSum<Acc> row, T* y) {
  const Acc inv = Acc(1) / row.s;
#pragma unroll
  for (int v = 0; v < VPT; ++v)
    if (x.valid(v)) {
      Pack<T, N> out;
      if constexpr (N % 2 == 0) {
#pragma unroll
        for (int k = 0; k < N; k += 2)
          from_acc2<T>(exp_acc(to_acc(x.buf[v].v[k]) - row.m) * inv, exp_acc(to_acc(x.buf[v].v[k + 1]) - row.m) * inv,
                       &out.v[k]);
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) out.v[k] = from_acc<T>(exp_acc(to_acc(x.buf[v].v[k]) - row.m) * inv);
      }
      store_pack<S, T, N>(y + x.elem(v), out);
    }
}

template <typename T, int N, int VPT, typename Acc = typename AccOf<T>::type>
__device__ __forceinline__ Sum<Acc> dot_of(const Slice<T, N, VPT>& y, const Slice<T, N, VPT>& dy) {
  Acc s = 0;
#pragma unroll
  for (int v = 0; v < VPT; ++v)
    if (y.valid(v)) {
#pragma unroll
      for (int k = 0; k < N; ++k) s += to_acc(y.buf[v].v[k]) * to_acc(dy.buf[v].v[k]);
    }
  return {s};
}

// grad_x = y * (grad_y - dot).
template <St S, typename T, int N, int VPT, typename Acc = typename AccOf<T>::type>
__device__ __forceinline__ void write_grad(const Slice<T, N, VPT>& y, const Slice<T, N, VPT>& dy, Sum<Acc> dot,
                                           T* dx) {
#pragma unroll
  for (int v = 0; v < VPT; ++v)
    if (y.valid(v)) {
      Pack<T, N> out;
#pragma unroll
      for (int k = 0; k < N; ++k) out.v[k] = from_acc<T>(to_acc(y.buf[v].v[k]) * (to_acc(dy.buf[v].v[k]) - dot.s));
      store_pack<S, T, N>(dx + y.elem(v), out);
    }
}

// ---- forward kernels -------------------------------------------------------------------------------

constexpr int kWarpPathThreads = 128;

// x, y: [rows, cols]. One row per group of `group` lanes (a power of two <= 32); kWarpPathThreads / group
// rows per block.
template <typename T, int N, int VPT>
__global__ void __launch_bounds__(kWarpPathThreads)
    forward_warp_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t cols, int group) {
  const int64_t row = int64_t(blockIdx.x) * (kWarpPathThreads / group) + threadIdx.x / group;
  const bool active = row < rows;
  Slice<T, N, VPT> xs;
  xs.base = threadIdx.x % group;
  xs.stride = group;
  xs.count = active ? cols / N : 0;  // inactive groups still take part in the shuffles
  xs.template load<Ld::Nc>(x + row * cols);
  write_softmax<St::Wb>(xs, group_allreduce(max_sum_of(xs), group), y + row * cols);
}

// x, y: [rows, cols]. One row per cluster of gridDim.x / rows blocks (1 without a cluster launch);
// each block owns blockDim.x * VPT consecutive vectors of it.
template <typename T, int N, int VPT, int MAX_THREADS, Ld LD = Ld::Nc, St ST = St::Wb>
__global__ void __launch_bounds__(MAX_THREADS)
    forward_block_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t cols) {
  using Acc = typename AccOf<T>::type;
  __shared__ MaxSum<Acc> scratch[32];
  __shared__ MaxSum<Acc> slot;
  const Cluster cluster = Cluster::current();
  const int64_t row = blockIdx.x / cluster.size;
  Slice<T, N, VPT> xs;
  xs.base = int64_t(cluster.rank) * blockDim.x * VPT + threadIdx.x;
  xs.stride = blockDim.x;
  xs.count = cols / N;
  xs.template load<LD>(x + row * cols);
  const MaxSum<Acc> r = cluster.allreduce(block_allreduce(max_sum_of(xs), scratch), &slot);
  cluster.done_reading();
  write_softmax<ST>(xs, r, y + row * cols);
  cluster.wait_peers();
}

// The row's max alone, for the two-reduction kernel below.
template <typename Acc>
struct Max {
  Acc m;

  __device__ __forceinline__ static Max identity() { return {neg_inf<Acc>()}; }
  __device__ __forceinline__ static Max merge(Max a, Max b) { return {max_nan(a.m, b.m)}; }
  __device__ __forceinline__ Max shfl_xor(int offset, int width) const {
    return {__shfl_xor_sync(0xffffffffu, m, offset, width)};
  }
};

// The block path for one block a row (no cluster), in two reductions: the row's max first, then
// e = exp(x - max) once an element, kept in registers, summed, and scaled: one exp an element where
// forward_block_kernel takes two (one for its partial sum, one for y), and no exp in the merges. An all
// -inf row has max -inf and gives NaN (exp(-inf - -inf)), as torch does; a NaN anywhere gives a NaN max.
template <typename T, int N, int VPT, int MAX_THREADS, Ld LD = Ld::Nc, St ST = St::Wb>
__global__ void __launch_bounds__(MAX_THREADS)
    forward_block_once_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t cols) {
  using Acc = typename AccOf<T>::type;
  __shared__ Max<Acc> max_scratch[32];
  __shared__ Sum<Acc> sum_scratch[32];  // a second buffer: a fast warp must not overwrite the maxima
  const int64_t row = blockIdx.x;
  Slice<T, N, VPT> xs;
  xs.base = threadIdx.x;
  xs.stride = blockDim.x;
  xs.count = cols / N;
  xs.template load<LD>(x + row * cols);
  const Acc m = block_allreduce(Max<Acc>{max_of(xs)}, max_scratch).m;
  Acc e[VPT][N];
  Acc s = 0;
#pragma unroll
  for (int v = 0; v < VPT; ++v)
    if (xs.valid(v)) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        e[v][k] = exp_acc(to_acc(xs.buf[v].v[k]) - m);
        s += e[v][k];
      }
    }
  const Acc inv = Acc(1) / block_allreduce(Sum<Acc>{s}, sum_scratch).s;
#pragma unroll
  for (int v = 0; v < VPT; ++v)
    if (xs.valid(v)) {
      Pack<T, N> out;
      if constexpr (N % 2 == 0) {
#pragma unroll
        for (int k = 0; k < N; k += 2) from_acc2<T>(e[v][k] * inv, e[v][k + 1] * inv, &out.v[k]);
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) out.v[k] = from_acc<T>(e[v][k] * inv);
      }
      store_pack<ST, T, N>(y + row * cols + xs.elem(v), out);
    }
}

// Split path, kernel 1. Block b handles chunk b % splits of row b / splits and writes its (max, sum)
// to partials[b]. Plain loads, so kernel 2's second read of x can hit L2.
template <typename T, int N, int VPT>
__global__ void __launch_bounds__(256)
    forward_split_partial_kernel(const T* __restrict__ x, MaxSum<typename AccOf<T>::type>* __restrict__ partials,
                                 int64_t cols, int64_t splits) {
  using Acc = typename AccOf<T>::type;
  __shared__ MaxSum<Acc> scratch[32];
  const int64_t row = blockIdx.x / splits;
  const int64_t chunk = blockIdx.x % splits;
  Slice<T, N, VPT> xs;
  xs.base = chunk * blockDim.x * VPT + threadIdx.x;
  xs.stride = blockDim.x;
  xs.count = cols / N;
  xs.template load<Ld::Nc>(x + row * cols);
  MaxSum<Acc> r = block_allreduce(max_sum_of(xs), scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = r;
}

// Split path, kernel 2: the same chunk again, the row's `splits` partials merged, y written.
template <typename T, int N, int VPT>
__global__ void __launch_bounds__(256)
    forward_split_finish_kernel(const T* __restrict__ x, T* __restrict__ y,
                                const MaxSum<typename AccOf<T>::type>* __restrict__ partials, int64_t cols,
                                int64_t splits) {
  using Acc = typename AccOf<T>::type;
  __shared__ MaxSum<Acc> scratch[32];
  const int64_t row = blockIdx.x / splits;
  const int64_t chunk = blockIdx.x % splits;
  Slice<T, N, VPT> xs;
  xs.base = chunk * blockDim.x * VPT + threadIdx.x;
  xs.stride = blockDim.x;
  xs.count = cols / N;
  xs.template load<Ld::Cs>(x + row * cols);
  MaxSum<Acc> r = MaxSum<Acc>::identity();
  for (int64_t i = threadIdx.x; i < splits; i += blockDim.x) r = MaxSum<Acc>::merge(r, partials[row * splits + i]);
  r = block_allreduce(r, scratch);
  write_softmax<St::Cs>(xs, r, y + row * cols);
}

// ---- backward kernels ------------------------------------------------------------------------------

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(kWarpPathThreads)
    backward_warp_kernel(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, int64_t rows,
                         int64_t cols, int group) {
  const int64_t row = int64_t(blockIdx.x) * (kWarpPathThreads / group) + threadIdx.x / group;
  const bool active = row < rows;
  Slice<T, N, VPT> ys, dys;
  ys.base = dys.base = threadIdx.x % group;
  ys.stride = dys.stride = group;
  ys.count = dys.count = active ? cols / N : 0;
  ys.template load<Ld::Cs>(y + row * cols);
  dys.template load<Ld::Cs>(dy + row * cols);
  Sum<typename AccOf<T>::type> dot = group_allreduce(dot_of(ys, dys), group);
  write_grad<St::Cs>(ys, dys, dot, dx + row * cols);
}

// LD_Y, LD_DY, ST: cache policies of y's and grad_y's loads and grad_x's stores (the launcher picks them).
template <typename T, int N, int VPT, int MAX_THREADS, Ld LD_Y = Ld::Cs, Ld LD_DY = Ld::Cs, St ST = St::Cs>
__global__ void __launch_bounds__(MAX_THREADS)
    backward_block_kernel(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, int64_t cols) {
  using Acc = typename AccOf<T>::type;
  __shared__ Sum<Acc> scratch[32];
  __shared__ Sum<Acc> slot;
  const Cluster cluster = Cluster::current();
  const int64_t row = blockIdx.x / cluster.size;
  Slice<T, N, VPT> ys, dys;
  ys.base = dys.base = int64_t(cluster.rank) * blockDim.x * VPT + threadIdx.x;
  ys.stride = dys.stride = blockDim.x;
  ys.count = dys.count = cols / N;
  ys.template load<LD_Y>(y + row * cols);
  dys.template load<LD_DY>(dy + row * cols);
  Sum<Acc> dot = block_allreduce(dot_of(ys, dys), scratch);
  dot = cluster.allreduce(dot, &slot);
  cluster.done_reading();
  write_grad<ST>(ys, dys, dot, dx + row * cols);
  cluster.wait_peers();
}

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(256)
    backward_split_partial_kernel(const T* __restrict__ y, const T* __restrict__ dy,
                                  Sum<typename AccOf<T>::type>* __restrict__ partials, int64_t cols, int64_t splits) {
  using Acc = typename AccOf<T>::type;
  __shared__ Sum<Acc> scratch[32];
  const int64_t row = blockIdx.x / splits;
  const int64_t chunk = blockIdx.x % splits;
  Slice<T, N, VPT> ys, dys;
  ys.base = dys.base = chunk * blockDim.x * VPT + threadIdx.x;
  ys.stride = dys.stride = blockDim.x;
  ys.count = dys.count = cols / N;
  ys.template load<Ld::Nc>(y + row * cols);
  dys.template load<Ld::Nc>(dy + row * cols);
  Sum<Acc> dot = block_allreduce(dot_of(ys, dys), scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = dot;
}

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(256)
    backward_split_finish_kernel(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx,
                                 const Sum<typename AccOf<T>::type>* __restrict__ partials, int64_t cols,
                                 int64_t splits) {
  using Acc = typename AccOf<T>::type;
  __shared__ Sum<Acc> scratch[32];
  const int64_t row = blockIdx.x / splits;
  const int64_t chunk = blockIdx.x % splits;
  Slice<T, N, VPT> ys, dys;
  ys.base = dys.base = chunk * blockDim.x * VPT + threadIdx.x;
  ys.stride = dys.stride = blockDim.x;
  ys.count = dys.count = cols / N;
  ys.template load<Ld::Cs>(y + row * cols);
  dys.template load<Ld::Cs>(dy + row * cols);
  Sum<Acc> dot = Sum<Acc>::identity();
  for (int64_t i = threadIdx.x; i < splits; i += blockDim.x) dot = Sum<Acc>::merge(dot, partials[row * splits + i]);
  dot = block_allreduce(dot, scratch);
  write_grad<St::Cs>(ys, dys, dot, dx + row * cols);
}

}  // namespace opb::softmax
