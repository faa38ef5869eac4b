// fused_relu_layernorm as Torch ops: schemas, input checks, CPU and CUDA implementations.
//
//   fused_relu_layernorm(x, weight?, bias?, eps) -> (y, mean, rstd)
//     y = layer_norm(relu(x), [hidden], weight, bias, eps); mean/rstd: x.shape[:-1], float32
//     (float64 for float64 x), saved for the backward.
//   fused_relu_layernorm_backward(grad_y, x, weight?, mean, rstd, affine_grads) -> (grad_x, grad_weight, grad_bias)
//     grad_weight/grad_bias: [hidden] when affine_grads, else [0].
#include <opbuilder/binding.h>

#include <limits>
#include <tuple>
#include <vector>

#include "fused_relu_layernorm_cpu.h"
#ifdef OPB_WITH_CUDA
#include "fused_relu_layernorm.cuh"
#endif

namespace {

namespace frln = opb::fused_relu_layernorm;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

constexpr const char* kFwd = "fused_relu_layernorm";
constexpr const char* kBwd = "fused_relu_layernorm_backward";

at::ScalarType stats_type(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

std::vector<int64_t> leading_sizes(const at::Tensor& x) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

// `t` must have x's dtype and device and shape [hidden].
void check_param(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", arg, " must have x's dtype ", x.scalar_type(), ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), op, ": ", arg, " must be on x's device ", x.device(), ", got ", t.device());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(-1), op, ": ", arg, " must have shape [", x.size(-1),
              "] to match x's last dim, got ", t.sizes());
}

void check_x(const char* op, const at::Tensor& x) {
  opb::dtype_of(x, op, "x");
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension (the normalized one), got a 0-d tensor");
}

struct FwdInputs {
  at::Tensor x, w, b;  // contiguous; w/b undefined when absent
};

FwdInputs prepare_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias) {
  check_x(kFwd, x);
  FwdInputs in{x.contiguous(), {}, {}};
  if (weight.has_value() && weight->defined()) {
    check_param(kFwd, "weight", *weight, x);
    in.w = weight->contiguous();
  }
  if (bias.has_value() && bias->defined()) {
    check_param(kFwd, "bias", *bias, x);
    in.b = bias->contiguous();
  }
  return in;
}

const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

// Allocates the outputs and fills the launcher's arguments; `run` launches when there is work.
template <typename Run>
Tensor3 forward_impl(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias, double eps, Run run) {
  FwdInputs in = prepare_forward(x, weight, bias);
  at::Tensor y = opb::new_output(in.x);
  const auto stats_opts = in.x.options().dtype(stats_type(in.x));
  at::Tensor mean = in.x.new_empty(leading_sizes(in.x), stats_opts);
  at::Tensor rstd = in.x.new_empty(leading_sizes(in.x), stats_opts);
  const int64_t hidden = in.x.size(-1);
  const int64_t rows = hidden == 0 ? mean.numel() : in.x.numel() / hidden;
  if (hidden == 0) {
    // As torch.native_layer_norm: the mean of no values is 0, their variance 0/0.
    mean.zero_();
    rstd.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  if (rows == 0 || hidden == 0) return {y, mean, rstd};
  frln::FwdArgs args{in.x.const_data_ptr(), ptr_or_null(in.w), ptr_or_null(in.b), y.mutable_data_ptr(),
                     mean.mutable_data_ptr(), rstd.mutable_data_ptr(), rows, hidden, eps,
                     opb::dtype_of(in.x, kFwd, "x")};
  run(args, in.x);
  return {y, mean, rstd};
}

struct BwdInputs {
  at::Tensor dy, x, w, mean, rstd;
};

BwdInputs prepare_backward(const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const at::Tensor& mean, const at::Tensor& rstd) {
  check_x(kBwd, x);
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type(), kBwd, ": grad_y must have x's dtype ", x.scalar_type(),
              ", got ", grad_y.scalar_type());
  TORCH_CHECK(grad_y.device() == x.device(), kBwd, ": grad_y must be on x's device ", x.device(), ", got ",
              grad_y.device());
  TORCH_CHECK(grad_y.sizes() == x.sizes(), kBwd, ": grad_y must have x's shape ", x.sizes(), ", got ",
              grad_y.sizes());
  const std::vector<int64_t> lead = leading_sizes(x);
  auto check_stats = [&](const char* arg, const at::Tensor& t) {
    TORCH_CHECK(t.scalar_type() == stats_type(x), kBwd, ": ", arg, " must be ", stats_type(x), " for ",
                x.scalar_type(), " x, got ", t.scalar_type());
    TORCH_CHECK(t.device() == x.device(), kBwd, ": ", arg, " must be on x's device ", x.device(), ", got ",
                t.device());
    TORCH_CHECK(t.sizes() == at::IntArrayRef(lead), kBwd, ": ", arg, " must have shape ", at::IntArrayRef(lead),
                " (x's leading dims), got ", t.sizes());
  };
  check_stats("mean", mean);
  check_stats("rstd", rstd);
  BwdInputs in{grad_y.contiguous(), x.contiguous(), {}, mean.contiguous(), rstd.contiguous()};
  if (weight.has_value() && weight->defined()) {
    check_param(kBwd, "weight", *weight, x);
    in.w = weight->contiguous();
  }
  return in;
}

template <typename Run>
Tensor3 backward_impl(const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const at::Tensor& mean, const at::Tensor& rstd, bool affine_grads, Run run) {
  BwdInputs in = prepare_backward(grad_y, x, weight, mean, rstd);
  const int64_t hidden = in.x.size(-1);
  at::Tensor dx = opb::new_output(in.x);
  at::Tensor dw = in.x.new_empty({affine_grads ? hidden : 0});
  at::Tensor db = in.x.new_empty({affine_grads ? hidden : 0});
  const int64_t rows = hidden == 0 ? 0 : in.x.numel() / hidden;
  if (rows == 0 || hidden == 0) {
    dw.zero_();  // a sum over no rows
    db.zero_();
    return {dx, dw, db};
  }
  frln::BwdArgs args{in.dy.const_data_ptr(), in.x.const_data_ptr(), ptr_or_null(in.w),
                     in.mean.const_data_ptr(), in.rstd.const_data_ptr(), dx.mutable_data_ptr(),
                     affine_grads ? dw.mutable_data_ptr() : nullptr, affine_grads ? db.mutable_data_ptr() : nullptr,
                     nullptr, rows, hidden, opb::dtype_of(in.x, kBwd, "x")};
  run(args, in.x);
  return {dx, dw, db};
}

Tensor3 forward_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, double eps) {
  return forward_impl(x, weight, bias, eps, [](const frln::FwdArgs& args, const at::Tensor&) { frln::forward_cpu(args); });
}

Tensor3 backward_cpu(const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                     const at::Tensor& mean, const at::Tensor& rstd, bool affine_grads) {
  return backward_impl(grad_y, x, weight, mean, rstd, affine_grads,
                       [](frln::BwdArgs& args, const at::Tensor&) { frln::backward_cpu(args); });
}

#ifdef OPB_WITH_CUDA
Tensor3 forward_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias, double eps) {
  c10::cuda::CUDAGuard guard(x.device());
  return forward_impl(x, weight, bias, eps, [](const frln::FwdArgs& args, const at::Tensor& xc) {
    opb::check_launch(frln::launch_forward(args, opb::stream_of(xc)), kFwd);
  });
}

Tensor3 backward_cuda(const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const at::Tensor& mean, const at::Tensor& rstd, bool affine_grads) {
  c10::cuda::CUDAGuard guard(x.device());
  return backward_impl(grad_y, x, weight, mean, rstd, affine_grads, [](frln::BwdArgs& args, const at::Tensor& xc) {
    // Per-CTA partial sums of dw and db, from the caching allocator (so CUDA graphs can capture it).
    const int64_t elems = frln::backward_workspace_elems(args);
    at::Tensor workspace;
    if (elems > 0) {
      workspace = xc.new_empty({elems}, xc.options().dtype(stats_type(xc)));
      args.workspace = workspace.mutable_data_ptr();
    }
    opb::check_launch(frln::launch_backward(args, opb::stream_of(xc)), kBwd);
  });
}
#endif

}  // namespace

OPB_LIBRARY(m) {
  m.def("fused_relu_layernorm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_relu_layernorm_backward(Tensor grad_y, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, "
      "bool affine_grads) -> (Tensor, Tensor, Tensor)");
}

OPB_LIBRARY_IMPL(CPU, m) {
  m.impl("fused_relu_layernorm", &forward_cpu);
  m.impl("fused_relu_layernorm_backward", &backward_cpu);
}

#ifdef OPB_WITH_CUDA
OPB_LIBRARY_IMPL(CUDA, m) {
  m.impl("fused_relu_layernorm", &forward_cuda);
  m.impl("fused_relu_layernorm_backward", &backward_cuda);
}
#endif
