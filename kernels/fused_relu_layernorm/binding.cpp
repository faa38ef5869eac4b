// fused_relu_layernorm as Torch ops on the LibTorch stable ABI: schemas, input checks, CPU and CUDA implementations.
//
//   fused_relu_layernorm(x, weight?, bias?, eps) -> (y, mean, rstd)
//     y = layer_norm(relu(x), [hidden], weight, bias, eps); mean/rstd: x.shape[:-1], float32
//     (float64 for float64 x), saved for the backward.
//   fused_relu_layernorm.nograd(x, weight?, bias?, eps) -> y
//     the same y, for calls that record no gradient: no autograd formula (ops/fused_relu_layernorm.py
//     registers none), and mean/rstd go to scratch memory instead of two more outputs to allocate and wrap.
//   fused_relu_layernorm_backward(grad_y, x, weight?, mean, rstd, affine_grads) -> (grad_x, grad_weight, grad_bias)
//     grad_weight/grad_bias: [hidden] when affine_grads, else [0].
#include <opbuilder/stable.h>

#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "fused_relu_layernorm_cpu.h"
#ifdef OPB_WITH_CUDA
#include "fused_relu_layernorm.cuh"
#endif

namespace {

namespace frln = opb::fused_relu_layernorm;
using opb::ScalarType;
using opb::Tensor;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;

constexpr const char* kFwd = "fused_relu_layernorm";
constexpr const char* kBwd = "fused_relu_layernorm_backward";

ScalarType stats_type(const Tensor& x) {
  return x.scalar_type() == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

std::vector<int64_t> leading_sizes(const Tensor& x) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

// `t` must have x's dtype and device and shape [hidden].
void check_param(const char* op, const char* arg, const Tensor& t, const Tensor& x) {
  STD_TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", arg, " must have x's dtype ", x.scalar_type(), ", got ",
                  t.scalar_type());
  STD_TORCH_CHECK(opb::same_device(t, x), op, ": ", arg, " must be on x's device ", opb::device_str(x), ", got ",
                  opb::device_str(t));
  STD_TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(-1), op, ": ", arg, " must have shape [", x.size(-1),
                  "] to match x's last dim, got ", opb::shape_str(t.sizes()));
}

void check_x(const char* op, const Tensor& x) {
  opb::dtype_of(x, op, "x");
  STD_TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension (the normalized one), got a 0-d tensor");
}

struct FwdInputs {
  Tensor x, w, b;  // contiguous; w/b undefined when absent
};

FwdInputs prepare_forward(const Tensor& x, const std::optional<Tensor>& weight,
                          const std::optional<Tensor>& bias) {
  check_x(kFwd, x);
  FwdInputs in{opb::contiguous(x), {}, {}};
  if (weight.has_value() && weight->defined()) {
    check_param(kFwd, "weight", *weight, x);
    in.w = opb::contiguous(*weight);
  }
  if (bias.has_value() && bias->defined()) {
    check_param(kFwd, "bias", *bias, x);
    in.b = opb::contiguous(*bias);
  }
  return in;
}

const void* ptr_or_null(const Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

// The launcher's arguments for y = layer_norm(relu(x)) into `y`, with each row's statistics to `mean`
// and `rstd` ([rows] of stats_type(x)); `run` launches. Only where there is work: rows, hidden >= 1.
template <typename Run>
void run_forward(const FwdInputs& in, const Tensor& y, void* mean, void* rstd, int64_t rows, double eps, Run run) {
  frln::FwdArgs args{in.x.const_data_ptr(), ptr_or_null(in.w), ptr_or_null(in.b), y.mutable_data_ptr(),
                     mean, rstd, rows, in.x.size(-1), eps, opb::dtype_of(in.x, kFwd, "x")};
  run(args, in.x);
}

// Allocates the outputs and fills the launcher's arguments; `run` launches when there is work.
template <typename Run>
Tensor3 forward_impl(const Tensor& x, const std::optional<Tensor>& weight,
                     const std::optional<Tensor>& bias, double eps, Run run) {
  FwdInputs in = prepare_forward(x, weight, bias);
  Tensor y = opb::new_output(in.x);
  const std::vector<int64_t> lead = leading_sizes(in.x);
  Tensor mean = opb::new_tensor(in.x, lead, stats_type(in.x));
  Tensor rstd = opb::new_tensor(in.x, lead, stats_type(in.x));
  const int64_t hidden = in.x.size(-1);
  const int64_t rows = hidden == 0 ? mean.numel() : in.x.numel() / hidden;
  if (hidden == 0) {
    // As torch.native_layer_norm: the mean of no values is 0, their variance 0/0.
    torch::stable::zero_(mean);
    torch::stable::fill_(rstd, std::numeric_limits<double>::quiet_NaN());
  }
  if (rows == 0 || hidden == 0) return {y, mean, rstd};
  run_forward(in, y, mean.mutable_data_ptr(), rstd.mutable_data_ptr(), rows, eps, run);
  return {y, mean, rstd};
}

// The no-grad forward: y alone. The kernels write the statistics anyway (a few bytes a row), into
// `scratch(in.x, rows)`: 2 x rows values of stats_type(x), mean then rstd, in memory the kernel can
// write, kept alive by the returned object until the launch is made.
template <typename Scratch, typename Run>
Tensor forward_y_impl(const Tensor& x, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                      double eps, Scratch scratch, Run run) {
  FwdInputs in = prepare_forward(x, weight, bias);
  Tensor y = opb::new_output(in.x);
  const int64_t hidden = in.x.size(-1);
  const int64_t rows = hidden == 0 ? 0 : in.x.numel() / hidden;
  if (rows == 0) return y;
  auto stats = scratch(in.x, rows);
  char* mean = static_cast<char*>(stats.data());
  run_forward(in, y, mean, mean + rows * (stats_type(in.x) == ScalarType::Double ? 8 : 4), rows, eps, run);
  return y;
}

// Host memory for the CPU kernel's statistics: no tensor to make (8 bytes a value fits either type).
struct HostScratch {
  std::unique_ptr<double[]> values;
  void* data() const { return values.get(); }
};

HostScratch host_scratch(const Tensor&, int64_t rows) { return {std::unique_ptr<double[]>(new double[2 * rows])}; }

struct BwdInputs {
  Tensor dy, x, w, mean, rstd;
};

BwdInputs prepare_backward(const Tensor& grad_y, const Tensor& x, const std::optional<Tensor>& weight,
                           const Tensor& mean, const Tensor& rstd) {
  check_x(kBwd, x);
  STD_TORCH_CHECK(grad_y.scalar_type() == x.scalar_type(), kBwd, ": grad_y must have x's dtype ", x.scalar_type(),
                  ", got ", grad_y.scalar_type());
  STD_TORCH_CHECK(opb::same_device(grad_y, x), kBwd, ": grad_y must be on x's device ", opb::device_str(x), ", got ",
                  opb::device_str(grad_y));
  STD_TORCH_CHECK(opb::same_shape(grad_y, x), kBwd, ": grad_y must have x's shape ", opb::shape_str(x.sizes()),
                  ", got ", opb::shape_str(grad_y.sizes()));
  const std::vector<int64_t> lead = leading_sizes(x);
  auto check_stats = [&](const char* arg, const Tensor& t) {
    STD_TORCH_CHECK(t.scalar_type() == stats_type(x), kBwd, ": ", arg, " must be ", stats_type(x), " for ",
                    x.scalar_type(), " x, got ", t.scalar_type());
    STD_TORCH_CHECK(opb::same_device(t, x), kBwd, ": ", arg, " must be on x's device ", opb::device_str(x), ", got ",
                    opb::device_str(t));
    STD_TORCH_CHECK(t.sizes().equals(lead), kBwd, ": ", arg, " must have shape ", opb::shape_str(lead),
                    " (x's leading dims), got ", opb::shape_str(t.sizes()));
  };
  check_stats("mean", mean);
  check_stats("rstd", rstd);
  BwdInputs in{opb::contiguous(grad_y), opb::contiguous(x), {}, opb::contiguous(mean),
               opb::contiguous(rstd)};
  if (weight.has_value() && weight->defined()) {
    check_param(kBwd, "weight", *weight, x);
    in.w = opb::contiguous(*weight);
  }
  return in;
}

template <typename Run>
Tensor3 backward_impl(const Tensor& grad_y, const Tensor& x, const std::optional<Tensor>& weight,
                      const Tensor& mean, const Tensor& rstd, bool affine_grads, Run run) {
  BwdInputs in = prepare_backward(grad_y, x, weight, mean, rstd);
  const int64_t hidden = in.x.size(-1);
  Tensor dx = opb::new_output(in.x);
  Tensor dw = opb::new_tensor(in.x, {affine_grads ? hidden : 0}, in.x.scalar_type());
  Tensor db = opb::new_tensor(in.x, {affine_grads ? hidden : 0}, in.x.scalar_type());
  const int64_t rows = hidden == 0 ? 0 : in.x.numel() / hidden;
  if (rows == 0 || hidden == 0) {
    torch::stable::zero_(dw);  // a sum over no rows
    torch::stable::zero_(db);
    return {dx, dw, db};
  }
  frln::BwdArgs args{in.dy.const_data_ptr(), in.x.const_data_ptr(), ptr_or_null(in.w),
                     in.mean.const_data_ptr(), in.rstd.const_data_ptr(), dx.mutable_data_ptr(),
                     affine_grads ? dw.mutable_data_ptr() : nullptr, affine_grads ? db.mutable_data_ptr() : nullptr,
                     nullptr, rows, hidden, opb::dtype_of(in.x, kBwd, "x")};
  run(args, in.x);
  return {dx, dw, db};
}

Tensor3 forward_cpu(const Tensor& x, const std::optional<Tensor>& weight,
                    const std::optional<Tensor>& bias, double eps) {
  return forward_impl(x, weight, bias, eps, [](const frln::FwdArgs& args, const Tensor&) { frln::forward_cpu(args); });
}

Tensor forward_y_cpu(const Tensor& x, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                    double eps) {
  return forward_y_impl(x, weight, bias, eps, host_scratch,
                        [](const frln::FwdArgs& args, const Tensor&) { frln::forward_cpu(args); });
}

Tensor3 backward_cpu(const Tensor& grad_y, const Tensor& x, const std::optional<Tensor>& weight,
                     const Tensor& mean, const Tensor& rstd, bool affine_grads) {
  return backward_impl(grad_y, x, weight, mean, rstd, affine_grads,
                       [](frln::BwdArgs& args, const Tensor&) { frln::backward_cpu(args); });
}

#ifdef OPB_WITH_CUDA
Tensor3 forward_cuda(const Tensor& x, const std::optional<Tensor>& weight,
                     const std::optional<Tensor>& bias, double eps) {
  const auto guard = opb::device_guard(x);
  return forward_impl(x, weight, bias, eps, [](const frln::FwdArgs& args, const Tensor& xc) {
    opb::check_launch(frln::launch_forward(args, opb::stream_of(xc)), kFwd);
  });
}

// Device memory for the GPU kernel's statistics, from torch's caching allocator (stream-ordered).
struct DeviceScratch {
  Tensor values;
  void* data() const { return values.mutable_data_ptr(); }
};

Tensor forward_y_cuda(const Tensor& x, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                      double eps) {
  const auto guard = opb::device_guard(x);
  auto scratch = [](const Tensor& xc, int64_t rows) {
    return DeviceScratch{opb::new_tensor(xc, {2 * rows}, stats_type(xc))};
  };
  return forward_y_impl(x, weight, bias, eps, scratch, [](const frln::FwdArgs& args, const Tensor& xc) {
    opb::check_launch(frln::launch_forward(args, opb::stream_of(xc)), kFwd);
  });
}

Tensor3 backward_cuda(const Tensor& grad_y, const Tensor& x, const std::optional<Tensor>& weight,
                      const Tensor& mean, const Tensor& rstd, bool affine_grads) {
  const auto guard = opb::device_guard(x);
  return backward_impl(grad_y, x, weight, mean, rstd, affine_grads, [](frln::BwdArgs& args, const Tensor& xc) {
    // Per-CTA partial sums of dw and db, from the caching allocator (so CUDA graphs can capture it).
    const int64_t elems = frln::backward_workspace_elems(args);
    Tensor workspace;
    if (elems > 0) {
      workspace = opb::new_tensor(xc, {elems}, stats_type(xc));
      args.workspace = workspace.mutable_data_ptr();
    }
    opb::check_launch(frln::launch_backward(args, opb::stream_of(xc)), kBwd);
  });
}
#endif

}  // namespace

OPB_LIBRARY(m) {
  m.def("fused_relu_layernorm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("fused_relu_layernorm.nograd(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor");
  m.def(
      "fused_relu_layernorm_backward(Tensor grad_y, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, "
      "bool affine_grads) -> (Tensor, Tensor, Tensor)");
}

OPB_LIBRARY_IMPL(CPU, m) {
  m.impl("fused_relu_layernorm", TORCH_BOX(&forward_cpu));
  m.impl("fused_relu_layernorm.nograd", TORCH_BOX(&forward_y_cpu));
  m.impl("fused_relu_layernorm_backward", TORCH_BOX(&backward_cpu));
}

#ifdef OPB_WITH_CUDA
OPB_LIBRARY_IMPL(CUDA, m) {
  m.impl("fused_relu_layernorm", TORCH_BOX(&forward_cuda));
  m.impl("fused_relu_layernorm.nograd", TORCH_BOX(&forward_y_cuda));
  m.impl("fused_relu_layernorm_backward", TORCH_BOX(&backward_cuda));
}
#endif
