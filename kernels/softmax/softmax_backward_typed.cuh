// softmax backward for one element type: the plan's kernel at the row's vector width. Included by one
// softmax_backward_<type>.cu per type, so that nvcc compiles the types in parallel and an edit of one
// recompiles that one.
#pragma once

#include "softmax_kernel.cuh"
#include "softmax_launch.cuh"
#include "softmax_typed.cuh"

namespace opb::softmax {
namespace detail {

template <typename T, int N>
cudaError_t backward_typed(const Problem& p, const Plan& plan, const T* y, const T* dy, T* dx, void* workspace,
                           cudaStream_t stream) {
  using Acc = typename AccOf<T>::type;
  switch (plan.path) {
    case Path::Warp:
      if constexpr (std::is_same_v<T, double>) {
        return cudaErrorInvalidValue;
      } else {
        return with_warp_vpt(plan.vpt, [&](auto vpt) {
          const int64_t blocks = (p.rows + kWarpPathThreads / plan.threads - 1) / (kWarpPathThreads / plan.threads);
          return launch(backward_warp_kernel<T, N, decltype(vpt)::value>, blocks, kWarpPathThreads, 1, stream, y, dy,
                        dx, p.rows, p.cols, plan.threads);
        });
      }
    case Path::Block:
      return with_vpt(plan.vpt, [&](auto vpt) {
        constexpr int kVpt = decltype(vpt)::value;
        const int64_t blocks = p.rows * plan.cluster;
        // Plain loads and stores for 1 or 2 vectors a thread, evict-first ones for more (H100,
        // benchmarks/NOTES.md: bf16 4096 cols 256x2 282 us plain against 290; in the forward+backward step
        // 512x1 plain 446 against 455; but bf16 32768 cols 1024x4 378 plain against 356).
        constexpr Ld kLoad = kVpt <= 2 ? Ld::Nc : Ld::Cs;
        constexpr St kStore = kVpt <= 2 ? St::Wb : St::Cs;
        if (plan.threads <= 256)
          return launch(backward_block_kernel<T, N, kVpt, 256, kLoad, kLoad, kStore>, blocks, plan.threads,
                        plan.cluster, stream, y, dy, dx, p.cols);
        if constexpr (kVpt == kBigVptBackward || kVpt == 1)
          return launch(backward_block_kernel<T, N, kVpt, 1024, kLoad, kLoad, kStore>, blocks, plan.threads,
                        plan.cluster, stream, y, dy, dx, p.cols);
        return cudaErrorInvalidValue;
      });
    case Path::Split: {
      if (plan.vpt != kSplitVpt) return cudaErrorInvalidValue;
      const int64_t splits = split_count(plan, p);
      auto* partials = static_cast<Sum<Acc>*>(workspace);
      cudaError_t err = launch(backward_split_partial_kernel<T, N, kSplitVpt>, p.rows * splits, plan.threads, 1,
                               stream, y, dy, partials, p.cols, splits);
      if (err != cudaSuccess) return err;
      return launch(backward_split_finish_kernel<T, N, kSplitVpt>, p.rows * splits, plan.threads, 1, stream, y, dy,
                    dx, static_cast<const Sum<Acc>*>(partials), p.cols, splits);
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace detail

template <typename T>
cudaError_t backward_vec(const Problem& p, const Plan& plan, const void* y, const void* dy, void* dx,
                         void* workspace, cudaStream_t stream) {
  const T* yt = static_cast<const T*>(y);
  const T* dyt = static_cast<const T*>(dy);
  T* dxt = static_cast<T*>(dx);
  if (p.vectorized) return detail::backward_typed<T, 16 / sizeof(T)>(p, plan, yt, dyt, dxt, workspace, stream);
  return detail::backward_typed<T, 1>(p, plan, yt, dyt, dxt, workspace, stream);
}

}  // namespace opb::softmax

#define OPB_SOFTMAX_BACKWARD(T) \
  namespace opb::softmax { template cudaError_t backward_vec<T>(const Problem&, const Plan&, const void*, const void*, void*, void*, cudaStream_t); }
