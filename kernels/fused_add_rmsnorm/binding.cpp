// fused_add_rmsnorm as Torch ops on the LibTorch stable ABI: schemas, input checks, CPU and CUDA implementations.
//
//   fused_add_rmsnorm(input, residual, weight, eps) -> (out, residual_out)
//   fused_add_rmsnorm_backward(grad_out, grad_residual_out?, residual_out, weight, eps) -> (grad_input, grad_weight)
//   fused_add_rmsnorm_backward.two_grads(same) -> (grad_input, grad_residual, grad_weight)
//   rms_norm(input, weight, eps) -> out                      (no residual: nothing extra read or written)
//   fused_add_rmsnorm.nograd, rms_norm.nograd                 the same with no autograd formula: what a call
//                                                            that records no gradient takes
//                                                            (ops/fused_add_rmsnorm.py registers none for them)
//
// grad_input is the gradient of both input and residual. two_grads returns it twice, as two tensors
// written by one kernel: autograd, handed one tensor for two inputs, clones it (a full read and write more).
// rms_norm's backward is fused_add_rmsnorm_backward with residual_out = rms_norm's input and no
// grad_residual_out.
#include <opbuilder/stable.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "fused_add_rmsnorm_cpu.h"
#ifdef OPB_WITH_CUDA
#include "fused_add_rmsnorm.cuh"
#endif

namespace {

namespace k = opb::fused_add_rmsnorm;
using opb::Tensor;

constexpr const char* kFwd = "fused_add_rmsnorm";
constexpr const char* kBwd = "fused_add_rmsnorm_backward";
constexpr const char* kRms = "rms_norm";

struct Rows {
  int64_t rows;
  int64_t hidden;
};

// `x` ([..., hidden]) and `weight` ([hidden]): float dtypes, the same dtype and device.
Rows check_x_and_weight(const char* op, const Tensor& x, const char* x_name, const Tensor& weight,
                        double eps) {
  STD_TORCH_CHECK(x.dim() >= 1, op, ": ", x_name,
                  " must have at least 1 dimension ([..., hidden]), got a 0-d tensor");
  opb::dtype_of(x, op, x_name);
  opb::dtype_of(weight, op, "weight");
  STD_TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight must have ", x_name, "'s dtype ",
                  x.scalar_type(), ", got ", weight.scalar_type());
  STD_TORCH_CHECK(opb::same_device(weight, x), op, ": weight must be on ", x_name, "'s device ", opb::device_str(x),
                  ", got ", opb::device_str(weight));
  const int64_t hidden = x.size(-1);
  STD_TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, op, ": weight must have shape [", hidden,
                  "] to match ", x_name, "'s last dim, got ", opb::shape_str(weight.sizes()));
  STD_TORCH_CHECK(hidden <= INT32_MAX, op, ": ", x_name, "'s last dim must be at most ", INT32_MAX, ", got ",
                  hidden);
  STD_TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be a finite number >= 0, got ", eps);
  return {hidden == 0 ? 0 : x.numel() / hidden, hidden};
}

// `t` must match `ref` in dtype, device and shape.
void check_like(const char* op, const Tensor& ref, const char* ref_name, const Tensor& t, const char* name) {
  opb::dtype_of(t, op, name);
  STD_TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have ", ref_name, "'s dtype ",
                  ref.scalar_type(), ", got ", t.scalar_type());
  STD_TORCH_CHECK(opb::same_device(t, ref), op, ": ", name, " must be on ", ref_name, "'s device ",
                  opb::device_str(ref), ", got ", opb::device_str(t));
  STD_TORCH_CHECK(opb::same_shape(t, ref), op, ": ", name, " must have ", ref_name, "'s shape ",
                  opb::shape_str(ref.sizes()), ", got ", opb::shape_str(t.sizes()));
}

// Contiguous, and on CUDA 16-byte aligned (a view with an odd offset is copied): the kernels' loads are
// 16 bytes wide.
Tensor prepare(const Tensor& t) {
  Tensor c = opb::contiguous(t);
  if (c.is_cuda() && c.numel() > 0 && reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 != 0) {
    c = torch::stable::clone(c);
  }
  return c;
}

const void* ptr_or_null(const std::optional<Tensor>& t) {
  return t.has_value() ? t->const_data_ptr() : nullptr;
}

// ---- forward ---------------------------------------------------------------------------------------

std::tuple<Tensor, Tensor> fused_add_rmsnorm_impl(const Tensor& input, const Tensor& residual, const Tensor& weight,
                                                  double eps) {
  const Rows s = check_x_and_weight(kFwd, input, "input", weight, eps);
  check_like(kFwd, input, "input", residual, "residual");
  const Tensor x = prepare(input), r = prepare(residual), w = prepare(weight);
  Tensor out = opb::new_output(x), residual_out = opb::new_output(x);
  if (s.rows == 0) return {out, residual_out};
  const opb::DType dt = opb::dtype_of(x, kFwd, "input");
  if (x.is_cpu()) {
    k::forward_cpu(x.const_data_ptr(), r.const_data_ptr(), w.const_data_ptr(), out.mutable_data_ptr(),
                   residual_out.mutable_data_ptr(), s.rows, s.hidden, eps, dt);
  } else {
#ifdef OPB_WITH_CUDA
    const auto guard = opb::device_guard(x);
    opb::check_launch(k::launch_forward(x.const_data_ptr(), r.const_data_ptr(), w.const_data_ptr(),
                                        out.mutable_data_ptr(), residual_out.mutable_data_ptr(), s.rows, s.hidden,
                                        eps, dt, opb::stream_of(x)),
                      kFwd);
#endif
  }
  return {out, residual_out};
}

Tensor rms_norm_impl(const Tensor& input, const Tensor& weight, double eps) {
  const Rows s = check_x_and_weight(kRms, input, "input", weight, eps);
  const Tensor x = prepare(input), w = prepare(weight);
  Tensor out = opb::new_output(x);
  if (s.rows == 0) return out;
  const opb::DType dt = opb::dtype_of(x, kRms, "input");
  if (x.is_cpu()) {
    k::forward_cpu(x.const_data_ptr(), nullptr, w.const_data_ptr(), out.mutable_data_ptr(), nullptr, s.rows,
                   s.hidden, eps, dt);
  } else {
#ifdef OPB_WITH_CUDA
    const auto guard = opb::device_guard(x);
    opb::check_launch(k::launch_forward(x.const_data_ptr(), nullptr, w.const_data_ptr(), out.mutable_data_ptr(),
                                        nullptr, s.rows, s.hidden, eps, dt, opb::stream_of(x)),
                      kRms);
#endif
  }
  return out;
}

// ---- backward --------------------------------------------------------------------------------------

// two_grads: the second tensor is a copy of grad_input; else it is undefined.
std::tuple<Tensor, Tensor, Tensor> backward_common(const Tensor& grad_out,
                                                   const std::optional<Tensor>& grad_residual_out,
                                                   const Tensor& residual_out, const Tensor& weight, double eps,
                                                   bool two_grads) {
  const Rows s = check_x_and_weight(kBwd, residual_out, "residual_out", weight, eps);
  check_like(kBwd, residual_out, "residual_out", grad_out, "grad_out");
  if (grad_residual_out.has_value()) {
    check_like(kBwd, residual_out, "residual_out", *grad_residual_out, "grad_residual_out");
  }
  const Tensor gy = prepare(grad_out), h = prepare(residual_out), w = prepare(weight);
  std::optional<Tensor> gr;
  if (grad_residual_out.has_value()) gr = prepare(*grad_residual_out);
  Tensor grad_h = opb::new_output(h);
  Tensor grad_h2 = two_grads ? opb::new_output(h) : Tensor();
  void* grad_h2_ptr = two_grads ? grad_h2.mutable_data_ptr() : nullptr;
  Tensor grad_w = opb::new_output(w);
  // No rows: the weight gradient is an empty sum.
  if (s.rows == 0) return {grad_h, grad_h2, torch::stable::zero_(grad_w)};
  const opb::DType dt = opb::dtype_of(h, kBwd, "residual_out");
  if (h.is_cpu()) {
    k::backward_cpu(gy.const_data_ptr(), ptr_or_null(gr), h.const_data_ptr(), w.const_data_ptr(),
                    grad_h.mutable_data_ptr(), grad_h2_ptr, grad_w.mutable_data_ptr(), s.rows, s.hidden, eps, dt);
  } else {
#ifdef OPB_WITH_CUDA
    const auto guard = opb::device_guard(h);
    const int64_t ws_size = k::backward_workspace_size(s.rows, s.hidden, dt);
    Tensor ws = opb::new_tensor(
        h, {ws_size}, dt == opb::DType::Float64 ? opb::ScalarType::Double : opb::ScalarType::Float);
    opb::check_launch(k::launch_backward(gy.const_data_ptr(), ptr_or_null(gr), h.const_data_ptr(), w.const_data_ptr(),
                                         grad_h.mutable_data_ptr(), grad_h2_ptr, grad_w.mutable_data_ptr(),
                                         ws.mutable_data_ptr(), ws_size, s.rows, s.hidden, eps, dt, opb::stream_of(h)),
                      kBwd);
#endif
  }
  return {grad_h, grad_h2, grad_w};
}

std::tuple<Tensor, Tensor> backward_impl(const Tensor& grad_out, const std::optional<Tensor>& grad_residual_out,
                                         const Tensor& residual_out, const Tensor& weight, double eps) {
  auto [grad_h, unused, grad_w] = backward_common(grad_out, grad_residual_out, residual_out, weight, eps, false);
  return {grad_h, grad_w};
}

std::tuple<Tensor, Tensor, Tensor> backward_two_grads_impl(
    const Tensor& grad_out, const std::optional<Tensor>& grad_residual_out, const Tensor& residual_out,
    const Tensor& weight, double eps) {
  return backward_common(grad_out, grad_residual_out, residual_out, weight, eps, true);
}

}  // namespace

OPB_LIBRARY(m) {
  m.def("fused_add_rmsnorm(Tensor input, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "fused_add_rmsnorm_backward(Tensor grad_out, Tensor? grad_residual_out, Tensor residual_out, Tensor weight, "
      "float eps) -> (Tensor, Tensor)");
  m.def(
      "fused_add_rmsnorm_backward.two_grads(Tensor grad_out, Tensor? grad_residual_out, Tensor residual_out, "
      "Tensor weight, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rmsnorm.nograd(Tensor input, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm.nograd(Tensor input, Tensor weight, float eps) -> Tensor");
}

OPB_LIBRARY_IMPL(CPU, m) {
  m.impl("fused_add_rmsnorm", TORCH_BOX(&fused_add_rmsnorm_impl));
  m.impl("fused_add_rmsnorm_backward", TORCH_BOX(&backward_impl));
  m.impl("fused_add_rmsnorm_backward.two_grads", TORCH_BOX(&backward_two_grads_impl));
  m.impl("rms_norm", TORCH_BOX(&rms_norm_impl));
  m.impl("fused_add_rmsnorm.nograd", TORCH_BOX(&fused_add_rmsnorm_impl));
  m.impl("rms_norm.nograd", TORCH_BOX(&rms_norm_impl));
}

#ifdef OPB_WITH_CUDA
OPB_LIBRARY_IMPL(CUDA, m) {
  m.impl("fused_add_rmsnorm", TORCH_BOX(&fused_add_rmsnorm_impl));
  m.impl("fused_add_rmsnorm_backward", TORCH_BOX(&backward_impl));
  m.impl("fused_add_rmsnorm_backward.two_grads", TORCH_BOX(&backward_two_grads_impl));
  m.impl("rms_norm", TORCH_BOX(&rms_norm_impl));
  m.impl("fused_add_rmsnorm.nograd", TORCH_BOX(&fused_add_rmsnorm_impl));
  m.impl("rms_norm.nograd", TORCH_BOX(&rms_norm_impl));
}
#endif
