// fused_relu_layernorm's C++ gradient path (kernels/autograd/autograd.h):
// fused_relu_layernorm.grad(x, weight?, bias?, eps) -> y; the statistics (mean, rstd) stay in the Node.
// The registered overload (bind_registered) returns them too, not differentiable, as ops/fused_relu_layernorm.py's.
#pragma once

#include <autograd/autograd.h>

namespace opb::autograd::fused_relu_layernorm {

using Opt = const std::optional<Tensor>&;
using Forward = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, Opt, Opt, double);
using BackwardOp = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, Opt, const Tensor&,
                                                      const Tensor&, bool);
constexpr const char* kOp = "fused_relu_layernorm";

struct Ops {
  c10::TypedOperatorHandle<Forward> forward;
  c10::TypedOperatorHandle<BackwardOp> backward;
};

struct Backward final : torch::autograd::Node {
  std::shared_ptr<const Ops> ops;
  SavedVariable x, weight, mean, rstd;

  variable_list apply(variable_list&& grads) override {
    const bool need_w = task_should_compute_output(1), need_b = task_should_compute_output(2);
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    const Tensor w = weight.unpack(), input = x.unpack();
    auto [gx, gw, gb] = below(ops->backward, grads[0], input, w.defined() ? std::optional<Tensor>(w) : std::nullopt,
                              mean.unpack(), rstd.unpack(), need_w || need_b);
    return once_differentiable(
        kOp, {task_should_compute_output(0) ? gx : Tensor(), need_w ? gw : Tensor(), need_b ? gb : Tensor()},
        {grads[0], input, w});
  }
  std::string name() const override { return "opbuilder::FusedReluLayerNormBackward"; }
  void release_variables() override {
    x.reset_data();
    weight.reset_data();
    mean.reset_data();
    rstd.reset_data();
  }
};

// Runs the forward below autograd and records the Node; returns (y, mean, rstd).
inline std::tuple<Tensor, Tensor, Tensor> record(const std::shared_ptr<const Ops>& ops, const Tensor& x, Opt weight,
                                                 Opt bias, double eps) {
  auto [y, mean, rstd] = below(ops->forward, x, weight, bias, eps);
  const Tensor w = or_undefined(weight), b = or_undefined(bias);
  if (torch::autograd::compute_requires_grad(x, w, b)) {
    auto node = make_node<Backward>(x, w, b);
    node->ops = ops;
    node->x = SavedVariable(savable(x), false);
    node->weight = SavedVariable(w, false);
    node->mean = SavedVariable(mean, false);
    node->rstd = SavedVariable(rstd, false);
    set_grad_fn({y}, node);
  }
  return {y, mean, rstd};
}

inline std::shared_ptr<const Ops> find_ops(const Registrar& r) {
  return std::make_shared<const Ops>(
      Ops{find<Forward>(r.ns, kOp, ""), find<BackwardOp>(r.ns, "fused_relu_layernorm_backward", "")});
}

inline std::vector<std::string> bind_registered(Registrar& r) {
  r.lib.impl(kOp, torch::dispatch(c10::DispatchKey::Autograd,
                                  [ops = find_ops(r)](const Tensor& x, Opt weight, Opt bias, double eps) {
                                    no_forward_ad(kOp, x, or_undefined(weight), or_undefined(bias));
                                    return record(ops, x, weight, bias, eps);
                                  }));
  return {kOp};
}

inline void bind(Registrar& r) {
  r.lib.def("fused_relu_layernorm.grad(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor");
  r.lib.impl("fused_relu_layernorm.grad",
             torch::dispatch(c10::DispatchKey::Autograd, [ops = find_ops(r)](const Tensor& x, Opt weight, Opt bias,
                                                                            double eps) -> Tensor {
               // x: contiguous (the Python function makes it so, and the backward reads the saved x).
               return std::get<0>(record(ops, x, weight, bias, eps));
             }));
}

}  // namespace opb::autograd::fused_relu_layernorm
