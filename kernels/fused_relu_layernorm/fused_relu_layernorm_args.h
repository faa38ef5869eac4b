// What one call of fused_relu_layernorm's forward or backward works on: raw pointers and sizes,
// shared by the binding, the CPU kernel and the CUDA launchers (no torch or CUDA types).
#pragma once

#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::fused_relu_layernorm {

// y = layer_norm(relu(x)) over the last dim; mean/rstd per row for the backward.
struct FwdArgs {
  const void* x;     // [rows, hidden], dtype
  const void* w;     // [hidden], dtype, or null (no scale)
  const void* b;     // [hidden], dtype, or null (no shift)
  void* y;           // [rows, hidden], dtype
  void* mean;        // [rows], float32 (float64 for Float64 data)
  void* rstd;        // [rows], likewise
  int64_t rows;
  int64_t hidden;
  double eps;
  DType dtype;
};

struct BwdArgs {
  const void* dy;    // [rows, hidden], dtype
  const void* x;     // [rows, hidden], dtype
  const void* w;     // [hidden], dtype, or null
  const void* mean;  // [rows], float32 (float64 for Float64 data)
  const void* rstd;  // [rows], likewise
  void* dx;          // [rows, hidden], dtype
  void* dw;          // [hidden], dtype, or null: no weight/bias gradients wanted
  void* db;          // [hidden], dtype, or null exactly when dw is
  void* workspace;   // CUDA only: backward_workspace_elems(args) elements of the stats' type
  int64_t rows;
  int64_t hidden;
  DType dtype;
};

}  // namespace opb::fused_relu_layernorm
