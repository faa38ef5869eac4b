// softmax forward for one element type: the plan's kernel at the row's vector width. Included by one
// softmax_forward_<type>.cu per type, so that nvcc compiles the types in parallel and an edit of one
// recompiles that one.
#pragma once

#include "softmax_kernel.cuh"
#include "softmax_launch.cuh"
#include "softmax_typed.cuh"

namespace opb::softmax {
namespace detail {

template <typename T, int N>
cudaError_t forward_typed(const Problem& p, const Plan& plan, const T* x, T* y, void* workspace,
                          cudaStream_t stream) {
  using Acc = typename AccOf<T>::type;
  switch (plan.path) {
    case Path::Warp:
      if constexpr (std::is_same_v<T, double>) {
        return cudaErrorInvalidValue;
      } else {
        return with_warp_vpt(plan.vpt, [&](auto vpt) {
          const int64_t blocks = (p.rows + kWarpPathThreads / plan.threads - 1) / (kWarpPathThreads / plan.threads);
          return launch(forward_warp_kernel<T, N, decltype(vpt)::value>, blocks, kWarpPathThreads, 1, stream, x, y,
                        p.rows, p.cols, plan.threads);
        });
      }
    case Path::Block:
      return with_vpt(plan.vpt, [&](auto vpt) {
        constexpr int kVpt = decltype(vpt)::value;
        const int64_t blocks = p.rows * plan.cluster;
        // A row in one block of <= 256 threads, 16-byte vectors, at most 32 elements a thread: two
        // reductions and one exp an element, and for float32 evict-first stores of y (H100,
        // benchmarks/NOTES.md: fp32 4096 cols 128x8 49.7 -> 49.2 us, bf16 4096 cols 128x4 27.7 -> 27.0 us
        // and 185.5 -> 184.7 us at 32768 rows; for bf16 evict-first stores were 1-2 us slower). More
        // elements a thread (bf16 256x8: 94.4 -> 103.5 us at 4096 x 16384), longer rows (fp32 32768
        // cols: 1441 against 1444 us), clusters and float64 keep the one-reduction kernel.
        if constexpr (!std::is_same_v<T, double> && N * sizeof(T) == 16 && N * kVpt <= 32) {
          if (plan.threads <= 256 && plan.cluster == 1) {
            constexpr St kStore = sizeof(T) == 4 ? St::Cs : St::Wb;
            return launch(forward_block_once_kernel<T, N, kVpt, 256, Ld::Nc, kStore>, blocks, plan.threads, 1,
                          stream, x, y, p.cols);
          }
        }
        if (plan.threads <= 256)
          return launch(forward_block_kernel<T, N, kVpt, 256>, blocks, plan.threads, plan.cluster, stream, x, y,
                        p.cols);
        if constexpr (kVpt == kBigVptForward)
          return launch(forward_block_kernel<T, N, kVpt, 1024>, blocks, plan.threads, plan.cluster, stream, x, y,
                        p.cols);
        return cudaErrorInvalidValue;
      });
    case Path::Split: {
      if (plan.vpt != kSplitVpt) return cudaErrorInvalidValue;
      const int64_t splits = split_count(plan, p);
      auto* partials = static_cast<MaxSum<Acc>*>(workspace);
      cudaError_t err = launch(forward_split_partial_kernel<T, N, kSplitVpt>, p.rows * splits, plan.threads, 1, stream,
                               x, partials, p.cols, splits);
      if (err != cudaSuccess) return err;
      return launch(forward_split_finish_kernel<T, N, kSplitVpt>, p.rows * splits, plan.threads, 1, stream, x, y,
                    static_cast<const MaxSum<Acc>*>(partials), p.cols, splits);
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace detail

template <typename T>
cudaError_t forward_vec(const Problem& p, const Plan& plan, const void* x, void* y, void* workspace,
                        cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  T* yt = static_cast<T*>(y);
  if (p.vectorized) return detail::forward_typed<T, 16 / sizeof(T)>(p, plan, xt, yt, workspace, stream);
  return detail::forward_typed<T, 1>(p, plan, xt, yt, workspace, stream);
}

}  // namespace opb::softmax

#define OPB_SOFTMAX_FORWARD(T) \
  namespace opb::softmax { template cudaError_t forward_vec<T>(const Problem&, const Plan&, const void*, void*, void*, cudaStream_t); }
