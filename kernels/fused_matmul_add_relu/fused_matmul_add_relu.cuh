// fused_matmul_add_relu's CUDA launcher, as the binding sees it: raw pointers, sizes, strides and a
// stream; no torch types. The GEMM and its bias + ReLU run in one cuBLASLt call (an epilogue).
#pragma once

#include <cuda_runtime_api.h>
#include <cstddef>
#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::fused_matmul_add_relu {

// One input as a batch of row-major [rows, cols] matrices, read in place.
struct Matrix {
  const void* data = nullptr;
  // false: element (r, c) at data[r * ld + c] (row-major, ld >= cols);
  // true:  element (r, c) at data[c * ld + r] (a transposed view, ld >= rows), e.g. weight.t().
  bool transposed = false;
  int64_t ld = 0;
  // Elements from one batch entry to the next; 0 broadcasts one matrix over the batch.
  int64_t batch_stride = 0;
};

// out[b] = relu(lhs[b] @ rhs[b] + bias_vector + c[b]) for b < batch; every term after the product
// is optional. Sizes are > 0 (the binding handles empty problems).
struct Problem {
  int64_t batch = 1;
  int64_t m = 0, n = 0, k = 0;
  Matrix lhs;  // [batch, m, k]
  Matrix rhs;  // [batch, k, n]
  // [n]: one value per output column, added by cuBLASLt's RELU_BIAS epilogue; nullptr: none.
  const void* bias_vector = nullptr;
  // [batch, m, n] row-major with ld n, added with beta = 1 (D = relu(A B + C)); may be `out` itself
  // (in place). nullptr: none.
  const void* c = nullptr;
  int64_t c_batch_stride = 0;
  void* out = nullptr;  // [batch, m, n] contiguous
  DType dtype = DType::Float32;
  // float32 only: lets cuBLAS round the inputs to TF32 (torch.backends.cuda.matmul.allow_tf32).
  bool allow_tf32 = false;
};

enum class Status : int {
  Ok = 0,
  NotSupported = 1,  // cuBLASLt has no algorithm for this problem: the caller computes it another way
  Failed = 2,
};

struct Result {
  Status status;
  const char* message;  // static text; empty when Ok
};

// Where a call's workspace comes from: `get(ctx, bytes)` returns device memory of at least `bytes`,
// stream-ordered on the call's stream, valid until the call returns. Called only when the chosen
// algorithm needs a workspace, with the bytes it needs (at most Workspace::kMaxBytes).
struct Workspace {
  static constexpr size_t kMaxBytes = size_t(32) << 20;
  void* (*get)(void* ctx, size_t bytes) = nullptr;
  void* ctx = nullptr;
};

// Runs `p` on `stream` with the current device's cuBLASLt handle (created once per device).
Result launch(const Problem& p, const Workspace& workspace, cudaStream_t stream);

// Whether the cuBLAS handle `cublas_handle` (a cublasHandle_t: torch's current one) is in TF32 math mode,
// which torch sets on its handle from torch.backends.cuda.matmul.allow_tf32 each time it hands it out.
// False when the mode cannot be read.
bool tf32_math(void* cublas_handle);

}  // namespace opb::fused_matmul_add_relu

namespace opb::fused_matmul_add_relu {

// The backward's ReLU and bias terms in one pass (relu_bias_backward.cu): for [rows, cols] contiguous
// grad and out, grad_pre = threshold_backward(grad, out, 0) and grad_bias[c] = sum over rows of
// grad_pre[:, c]. workspace: workspace_bytes >= relu_bias_workspace_bytes(rows, cols, dtype) bytes of device
// memory (0: none needed, may be null), stream-ordered on `stream`; less gives cudaErrorInvalidValue.
int64_t relu_bias_workspace_bytes(int64_t rows, int64_t cols, DType dtype);
cudaError_t launch_relu_bias_backward(const void* grad, const void* out, void* grad_pre, void* grad_bias,
                                      void* workspace, int64_t workspace_bytes, int64_t rows, int64_t cols,
                                      DType dtype, cudaStream_t stream);

}  // namespace opb::fused_matmul_add_relu
