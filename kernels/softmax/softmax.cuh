// softmax's CUDA launchers, as the binding sees them: raw pointers, sizes, a plan and a stream; no torch
// types. All buffers are contiguous [rows, cols]; the softmax runs over cols.
#pragma once

#include <cuda_runtime_api.h>
#include <cstddef>
#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::softmax {

// Which kernel runs (softmax_kernel.cuh describes each).
enum class Path : int { Warp = 0, Block = 1, Split = 2 };

// A launch configuration. A "vector" is 16 bytes of a row when every row is 16-byte aligned, else one
// element.
//   Warp:  threads = lanes per row (1, 2, 4, ..., 32), vpt = vectors per lane (1, 2, 4); not float64.
//   Block: threads per block (a multiple of 32, <= 256; or <= 1024 with vpt = kBigVpt, or for the
//          backward vpt = 1), vpt = vectors per thread (1, 2, 4, 8), cluster = blocks per row (1..8; above
//          1 only where clusters run).
//   Split: threads per block (a multiple of 32, <= 256), vpt = 4, cluster = 1; blocks per row follow
//          from cols.
struct Plan {
  Path path = Path::Block;
  int threads = 256;
  int vpt = 8;
  int cluster = 1;
};

// The largest vpt a block of more than 256 threads may use (register budget at 1024 threads).
constexpr int kBigVptForward = 8;
constexpr int kBigVptBackward = 4;

struct Problem {
  int64_t rows = 0;
  int64_t cols = 0;
  DType dtype = DType::Float32;
  bool vectorized = false;  // from vectorizable()
  bool backward = false;
  int device = 0;
};

// True when cols is a multiple of 16 bytes' worth of elements and every pointer is 16-byte aligned.
bool vectorizable(int64_t cols, DType dtype, const void* const* ptrs, int n_ptrs);

// The plan the launchers use by default: the fastest for the shape that we know of.
Plan default_plan(const Problem& problem);

// nullptr when `plan` can run `problem` on its device, else why not.
const char* plan_error(const Plan& plan, const Problem& problem);

// Bytes of scratch the plan needs (0 except for the split path).
size_t workspace_bytes(const Plan& plan, const Problem& problem);

// x, y: [rows, cols]. workspace: workspace_bytes(plan, problem) bytes.
cudaError_t forward(const Problem& problem, const Plan& plan, const void* x, void* y, void* workspace,
                    cudaStream_t stream);

// y (the forward output), grad_y, grad_x: [rows, cols]. grad_x = y * (grad_y - sum(grad_y * y, cols)).
cudaError_t backward(const Problem& problem, const Plan& plan, const void* y, const void* grad_y, void* grad_x,
                     void* workspace, cudaStream_t stream);

}  // namespace opb::softmax
