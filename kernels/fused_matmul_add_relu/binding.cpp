// fused_matmul_add_relu as a Torch op on the LibTorch stable ABI: schema, input checks, CPU and CUDA implementations.
//
// out = relu(lhs @ rhs + bias). lhs: [M, K] or [B, M, K]; rhs: [K, N] or [B, K, N] (a batch of 1, or
// a 2-D operand, broadcasts); bias: broadcastable to out ([N] is the common case), or None.
// fused_matmul_add_relu.nograd: the same with no autograd formula, what a call that records no gradient
// takes (ops/fused_matmul_add_relu.py registers none for it). relu_bias_backward: the backward's ReLU
// and bias terms for the 2-D case, one pass (the C++ gradient path's, kernels/autograd).
#include <opbuilder/stable.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

#include "fused_matmul_add_relu_cpu.h"
#ifdef OPB_WITH_CUDA
#include "fused_matmul_add_relu.cuh"

// torch's cuBLAS handle for the current device and stream, in the math mode torch's TF32 setting asks
// for. In the stable C shim since torch 2.10, declared there under USE_CUDA only.
extern "C" AOTI_TORCH_EXPORT AOTITorchError torch_get_current_cuda_blas_handle(void** ret_handle);
#endif

namespace {

using opb::Tensor;

constexpr const char* kOp = "fused_matmul_add_relu";

struct Shape {
  int64_t batch, m, n, k;
  std::vector<int64_t> out;  // [M, N] or [B, M, N]
};

int64_t batch_of(const Tensor& t) { return t.dim() == 3 ? t.size(0) : 1; }

// Mirrors the checks in ops/fused_matmul_add_relu.py, so a direct torch.ops call fails the same way.
Shape check_inputs(const Tensor& lhs, const Tensor& rhs, const std::optional<Tensor>& bias) {
  opb::dtype_of(lhs, kOp, "lhs");
  STD_TORCH_CHECK(rhs.scalar_type() == lhs.scalar_type(), kOp, ": rhs must have lhs's dtype ", lhs.scalar_type(),
                  ", got ", rhs.scalar_type());
  STD_TORCH_CHECK(opb::same_device(rhs, lhs), kOp, ": rhs must be on lhs's device ", opb::device_str(lhs), ", got ",
                  opb::device_str(rhs));
  STD_TORCH_CHECK(lhs.dim() == 2 || lhs.dim() == 3, kOp, ": lhs must be 2-D [M, K] or 3-D [B, M, K], got shape ",
                  opb::shape_str(lhs.sizes()));
  STD_TORCH_CHECK(rhs.dim() == 2 || rhs.dim() == 3, kOp, ": rhs must be 2-D [K, N] or 3-D [B, K, N], got shape ",
                  opb::shape_str(rhs.sizes()));
  const int64_t k = lhs.size(-1);
  STD_TORCH_CHECK(rhs.size(-2) == k, kOp, ": rhs must have K=", k, " rows to match lhs's last dim, got ",
                  rhs.size(-2), " (rhs shape ", opb::shape_str(rhs.sizes()), ")");
  const int64_t bl = batch_of(lhs), br = batch_of(rhs);
  STD_TORCH_CHECK(bl == br || bl == 1 || br == 1, kOp, ": the batch dims of lhs and rhs must be equal or 1, got ",
                  bl, " (lhs) and ", br, " (rhs)");
  Shape s{bl == 1 ? br : bl, lhs.size(-2), rhs.size(-1), k, {}};
  if (lhs.dim() == 3 || rhs.dim() == 3) s.out.push_back(s.batch);
  s.out.push_back(s.m);
  s.out.push_back(s.n);
  if (bias.has_value()) {
    const Tensor& b = *bias;
    STD_TORCH_CHECK(b.scalar_type() == lhs.scalar_type(), kOp, ": bias must have lhs's dtype ", lhs.scalar_type(),
                    ", got ", b.scalar_type());
    STD_TORCH_CHECK(opb::same_device(b, lhs), kOp, ": bias must be on lhs's device ", opb::device_str(lhs),
                    ", got ", opb::device_str(b));
    bool ok = b.dim() <= static_cast<int64_t>(s.out.size());
    for (int64_t i = 1; ok && i <= b.dim(); ++i) {
      const int64_t have = b.size(-i), want = s.out[s.out.size() - i];
      ok = have == want || have == 1;
    }
    STD_TORCH_CHECK(ok, kOp, ": bias must broadcast to the output's shape ", opb::shape_str(s.out),
                    " (e.g. [N], [M, N] or the full shape), got ", opb::shape_str(b.sizes()));
  }
  return s;
}

// bias broadcast to out's shape (as expand would: stride 0 along a broadcast dim), or relu alone; for
// the CPU epilogue.
struct BiasView {
  const void* data = nullptr;
  int64_t sb = 0, sr = 0, sc = 0;
};

BiasView bias_view(const std::optional<Tensor>& bias, const Shape& s) {
  BiasView v;
  if (!bias.has_value()) return v;
  const Tensor& b = *bias;
  // Dim i of the output counted from the right (0: columns, 1: rows, 2: batch).
  auto stride = [&](int64_t i) { return i < b.dim() && b.size(-1 - i) != 1 ? b.stride(-1 - i) : int64_t(0); };
  v.data = b.const_data_ptr();
  v.sc = stride(0);
  v.sr = stride(1);
  v.sb = s.out.size() == 3 ? stride(2) : 0;
  return v;
}

Tensor forward_cpu(Tensor lhs, Tensor rhs, std::optional<Tensor> bias) {
  const Shape s = check_inputs(lhs, rhs, bias);
  const opb::DType dtype = opb::dtype_of(lhs, kOp, "lhs");
  // One GEMM by ATen (it reads transposed views without copies where BLAS can), then one fused pass for
  // the bias and the ReLU. The linear layer's 2-D product goes straight to ATen's CPU mm into our output
  // (the C shim's mm_out: no operator looked up by name, no boxed call; 0.5 us a call at 4x4); batches,
  // and their broadcasts, through matmul by the dispatcher.
  Tensor out;
  if (lhs.dim() == 2 && rhs.dim() == 2) {
    out = opb::new_tensor(lhs, s.out, lhs.scalar_type());
    TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(out.get(), lhs.get(), rhs.get()));
  } else {
    out = opb::contiguous(torch::stable::matmul(lhs, rhs));
  }
  STD_TORCH_CHECK(out.sizes().equals(s.out), kOp, ": internal error: matmul gave shape ",
                  opb::shape_str(out.sizes()), ", expected ", opb::shape_str(s.out));
  if (out.numel() == 0) return out;
  const BiasView b = bias_view(bias, s);
  opb::fused_matmul_add_relu::bias_relu_cpu(out.mutable_data_ptr(), b.data, s.batch, s.m, s.n, b.sb, b.sr, b.sc,
                                            dtype);
  return out;
}

constexpr const char* kBwd = "relu_bias_backward";

// relu_bias_backward(grad, out) -> (grad_pre, grad_bias): the backward's ReLU and bias terms of the 2-D
// (linear layer's) case in one pass, for the C++ gradient path: grad_pre = threshold_backward(grad, out, 0)
// and grad_bias = grad_pre.sum(0).
std::tuple<Tensor, Tensor> relu_bias_backward(Tensor grad, Tensor out) {
  const opb::DType dtype = opb::dtype_of(grad, kBwd, "grad");
  STD_TORCH_CHECK(grad.dim() == 2, kBwd, ": grad must be 2-D [M, N], got shape ", opb::shape_str(grad.sizes()));
  STD_TORCH_CHECK(out.scalar_type() == grad.scalar_type(), kBwd, ": out must have grad's dtype ",
                  grad.scalar_type(), ", got ", out.scalar_type());
  STD_TORCH_CHECK(opb::same_device(out, grad), kBwd, ": out must be on grad's device ", opb::device_str(grad),
                  ", got ", opb::device_str(out));
  STD_TORCH_CHECK(opb::same_shape(out, grad), kBwd, ": out must have grad's shape ", opb::shape_str(grad.sizes()),
                  ", got ", opb::shape_str(out.sizes()));
  const Tensor g = opb::contiguous(grad), o = opb::contiguous(out);
  const int64_t rows = g.size(0), cols = g.size(1);
  Tensor grad_pre = opb::new_output(g);
  Tensor grad_bias = opb::new_tensor(g, {cols}, g.scalar_type());
  if (rows == 0 || cols == 0) return {grad_pre, torch::stable::zero_(grad_bias)};
  if (g.is_cpu()) {
    opb::fused_matmul_add_relu::relu_bias_backward_cpu(g.const_data_ptr(), o.const_data_ptr(),
                                                       grad_pre.mutable_data_ptr(), grad_bias.mutable_data_ptr(), rows,
                                                       cols, dtype);
  } else {
#ifdef OPB_WITH_CUDA
    const auto guard = opb::device_guard(g);
    const int64_t ws_bytes = opb::fused_matmul_add_relu::relu_bias_workspace_bytes(rows, cols, dtype);
    Tensor ws;
    if (ws_bytes > 0) ws = opb::new_tensor(g, {ws_bytes}, opb::ScalarType::Byte);
    opb::check_launch(opb::fused_matmul_add_relu::launch_relu_bias_backward(
                          g.const_data_ptr(), o.const_data_ptr(), grad_pre.mutable_data_ptr(),
                          grad_bias.mutable_data_ptr(), ws_bytes > 0 ? ws.mutable_data_ptr() : nullptr, ws_bytes,
                          rows, cols, dtype, opb::stream_of(g)),
                      kBwd);
#endif
  }
  return {grad_pre, grad_bias};
}

#ifdef OPB_WITH_CUDA
using opb::fused_matmul_add_relu::Matrix;
using opb::fused_matmul_add_relu::Problem;
using opb::fused_matmul_add_relu::Status;

// The launcher's workspace, from torch's caching allocator (stream-ordered: cheap, and CUDA graphs can
// capture it), made only when the chosen algorithm needs one and kept until the call returns.
struct WorkspaceHolder {
  const Tensor* like;
  Tensor made;
  static void* get(void* ctx, size_t bytes) {
    auto* self = static_cast<WorkspaceHolder*>(ctx);
    self->made = opb::new_tensor(*self->like, {static_cast<int64_t>(bytes)}, opb::ScalarType::Byte);
    return self->made.mutable_data_ptr();
  }
};

// Reads `t` (2-D or 3-D) as a batch of matrices cuBLAS can use in place: row-major or a transposed
// view, any batch stride. False when it is neither (a copy is needed).
bool matrix_view(const Tensor& t, Matrix* mat) {
  const int64_t rows = t.size(-2), cols = t.size(-1), sr = t.stride(-2), sc = t.stride(-1);
  if ((cols == 1 || sc == 1) && (rows == 1 || sr >= cols)) {
    mat->transposed = false;
    mat->ld = rows == 1 ? cols : sr;
  } else if ((rows == 1 || sr == 1) && (cols == 1 || sc >= rows)) {
    mat->transposed = true;
    mat->ld = cols == 1 ? rows : sc;
  } else {
    return false;
  }
  mat->data = t.const_data_ptr();
  mat->batch_stride = t.dim() == 3 && t.size(0) > 1 ? t.stride(0) : 0;
  return true;
}

Tensor as_matrix(const Tensor& t, Matrix* mat) {
  if (matrix_view(t, mat)) return t;
  Tensor c = opb::contiguous(t);
  matrix_view(c, mat);
  return c;
}

// An in-place ATen op of one tensor argument (relu_), through the stable dispatcher call.
Tensor call_inplace(const char* name, const Tensor& self) {
  std::array<StableIValue, 1> stack{torch::stable::detail::from(self)};
  TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, "", stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}

// When cuBLASLt has no algorithm for a problem (unusual layouts or float64 epilogues): ATen's ops.
Tensor forward_composed(const Tensor& lhs, const Tensor& rhs, const std::optional<Tensor>& bias) {
  Tensor out = torch::stable::matmul(lhs, rhs);
  // out - (-1) * bias: the stable ops have subtract with alpha, not add.
  if (bias.has_value()) out = torch::stable::subtract(out, *bias, -1.0);
  return torch::stable::contiguous(call_inplace("aten::relu_", out));
}

// torch.backends.cuda.matmul.allow_tf32, as torch's own cuBLAS handle carries it.
bool allow_tf32() {
  void* handle = nullptr;
  TORCH_ERROR_CODE_CHECK(torch_get_current_cuda_blas_handle(&handle));
  return opb::fused_matmul_add_relu::tf32_math(handle);
}

Tensor forward_cuda(Tensor lhs, Tensor rhs, std::optional<Tensor> bias) {
  const Shape s = check_inputs(lhs, rhs, bias);
  const opb::DType dtype = opb::dtype_of(lhs, kOp, "lhs");
  const auto guard = opb::device_guard(lhs);
  Tensor out = opb::new_tensor(lhs, s.out, lhs.scalar_type());
  if (out.numel() == 0) return out;
  if (s.k == 0) {  // the product is all zeros: relu(bias)
    if (bias.has_value()) {
      torch::stable::copy_(out, *bias);  // copy_ broadcasts bias to out's shape
    } else {
      torch::stable::zero_(out);
    }
    return call_inplace("aten::relu_", out);
  }

  Problem p;
  p.batch = s.batch;
  p.m = s.m;
  p.n = s.n;
  p.k = s.k;
  p.dtype = dtype;
  p.allow_tf32 = dtype == opb::DType::Float32 && allow_tf32();
  p.out = out.mutable_data_ptr();
  const Tensor lhs_m = as_matrix(lhs, &p.lhs);
  const Tensor rhs_m = as_matrix(rhs, &p.rhs);

  Tensor bias_m;
  if (bias.has_value()) {
    const Tensor& b = *bias;
    auto dim = [&](int64_t i) { return i < b.dim() ? b.size(b.dim() - 1 - i) : int64_t(1); };  // from the right
    const int64_t bn = dim(0), bm = dim(1), bb = dim(2);
    if (bm == 1 && bb == 1) {
      // One value per output column ([N], [1, N], scalar): cuBLASLt's bias epilogue. The layer's [N] bias
      // is used as it is: a reshape is a dispatcher call found by name, a few us of host time a call.
      const Tensor row = b.dim() == 1 ? b : torch::stable::reshape(b, {bn});
      if (bn == s.n) {
        bias_m = opb::contiguous(row);
      } else {  // one value for every column: broadcast by copy_
        bias_m = opb::new_tensor(b, {s.n}, b.scalar_type());
        torch::stable::copy_(bias_m, row);
      }
      p.bias_vector = bias_m.const_data_ptr();
    } else if (bm == s.m && bn == s.n && bb == s.batch) {
      // The output's full shape: C = bias with beta = 1, so D = relu(A B + C) in the same pass.
      bias_m = opb::contiguous(b);
      p.c = bias_m.const_data_ptr();
      p.c_batch_stride = s.batch > 1 ? s.m * s.n : 0;
    } else {
      // Other broadcasts ([M, 1], [M, N] over a batch, ...): written into out, added in place (C = D).
      torch::stable::copy_(out, b);
      p.c = out.const_data_ptr();
      p.c_batch_stride = s.batch > 1 ? s.m * s.n : 0;
    }
  }

  // A shared rhs and a row-major lhs with evenly spaced batch entries is one GEMM of batch * m rows.
  if (p.batch > 1 && p.rhs.batch_stride == 0 && !p.lhs.transposed && p.lhs.batch_stride == p.m * p.lhs.ld &&
      (p.c == nullptr || p.c_batch_stride == p.m * p.n)) {
    p.m *= p.batch;
    p.batch = 1;
    p.lhs.batch_stride = 0;
    p.c_batch_stride = 0;
  }

  WorkspaceHolder holder{&lhs, {}};
  const auto result = opb::fused_matmul_add_relu::launch(p, {&WorkspaceHolder::get, &holder}, opb::stream_of(lhs));
  if (result.status == Status::NotSupported) return forward_composed(lhs, rhs, bias);
  STD_TORCH_CHECK(result.status == Status::Ok, kOp, ": cuBLASLt matmul failed: ", result.message);
  return out;
}
#endif

}  // namespace

OPB_LIBRARY(m) {
  m.def("fused_matmul_add_relu(Tensor lhs, Tensor rhs, Tensor? bias) -> Tensor");
  m.def("fused_matmul_add_relu.nograd(Tensor lhs, Tensor rhs, Tensor? bias) -> Tensor");
  m.def("relu_bias_backward(Tensor grad, Tensor out) -> (Tensor, Tensor)");
}

OPB_LIBRARY_IMPL(CPU, m) {
  m.impl("fused_matmul_add_relu", TORCH_BOX(&forward_cpu));
  m.impl("fused_matmul_add_relu.nograd", TORCH_BOX(&forward_cpu));
  m.impl("relu_bias_backward", TORCH_BOX(&relu_bias_backward));
}

#ifdef OPB_WITH_CUDA
OPB_LIBRARY_IMPL(CUDA, m) {
  m.impl("fused_matmul_add_relu", TORCH_BOX(&forward_cuda));
  m.impl("fused_matmul_add_relu.nograd", TORCH_BOX(&forward_cuda));
  m.impl("relu_bias_backward", TORCH_BOX(&relu_bias_backward));
}
#endif
