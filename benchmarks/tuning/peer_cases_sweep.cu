// Shim for benchmarks/tuning/peer_cases.py --sweep: softmax's own launchers (kernels/softmax/*.cu of whichever
// tree this is compiled against) with their default plans, behind a C interface, so that two trees' kernels
// (HEAD's and the working tree's) can be loaded side by side through ctypes and timed on the same shapes.
#include <cuda_runtime.h>
#include <cstdint>

#include "softmax/softmax.cuh"

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace sm = opb::softmax;

namespace {
sm::Problem problem(const void* a, const void* b, const void* c, int64_t rows, int64_t cols, int dtype,
                    bool backward) {
  sm::Problem p;
  p.rows = rows;
  p.cols = cols;
  p.dtype = static_cast<opb::DType>(dtype);
  const void* ptrs[3] = {a, b, c};
  p.vectorized = sm::vectorizable(cols, p.dtype, ptrs, c ? 3 : 2);
  p.backward = backward;
  cudaGetDevice(&p.device);
  return p;
}
}  // namespace

// plan: [path, threads, vpt, cluster] of the default plan; returns the workspace bytes it needs.
EXPORT int64_t s_plan(const void* x, const void* y, int64_t rows, int64_t cols, int dtype, int backward, int* plan) {
  const sm::Problem p = problem(x, y, backward ? y : nullptr, rows, cols, dtype, backward != 0);
  const sm::Plan pl = sm::default_plan(p);
  plan[0] = static_cast<int>(pl.path);
  plan[1] = pl.threads;
  plan[2] = pl.vpt;
  plan[3] = pl.cluster;
  return static_cast<int64_t>(sm::workspace_bytes(pl, p));
}

EXPORT int s_fwd(const void* x, void* y, int64_t rows, int64_t cols, int dtype, void* ws, cudaStream_t s) {
  const sm::Problem p = problem(x, y, nullptr, rows, cols, dtype, false);
  return sm::forward(p, sm::default_plan(p), x, y, ws, s);
}

EXPORT int s_bwd(const void* y, const void* dy, void* dx, int64_t rows, int64_t cols, int dtype, void* ws,
                 cudaStream_t s) {
  const sm::Problem p = problem(y, dy, dx, rows, cols, dtype, true);
  return sm::backward(p, sm::default_plan(p), y, dy, dx, ws, s);
}
