// fused_add_rmsnorm's and rms_norm's C++ gradient path (kernels/autograd/autograd.h):
//   fused_add_rmsnorm.grad(input, residual, weight, eps) -> (out, residual_out)
//   rms_norm.grad(input, weight, eps) -> out
// Both backwards are fused_add_rmsnorm_backward; when input and residual are both leaves the kernel writes
// their two gradients itself (the .two_grads overload), as ops/fused_add_rmsnorm.py explains. The registered
// overloads (bind_registered) get the same kernels, with the ops themselves below autograd.
#pragma once

#include <autograd/autograd.h>

namespace opb::autograd::fused_add_rmsnorm {

using Opt = const std::optional<Tensor>&;
using Fused = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double);
using Rms = Tensor(const Tensor&, const Tensor&, double);
using BackwardOp = std::tuple<Tensor, Tensor>(const Tensor&, Opt, const Tensor&, const Tensor&, double);
using BackwardTwo = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, Opt, const Tensor&, const Tensor&, double);

struct Ops {
  c10::TypedOperatorHandle<Fused> fused;
  c10::TypedOperatorHandle<Rms> rms;
  c10::TypedOperatorHandle<BackwardOp> backward;
  c10::TypedOperatorHandle<BackwardTwo> backward_two;
};

inline std::optional<Tensor> defined_or_none(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

struct FusedBackward final : torch::autograd::Node {
  std::shared_ptr<const Ops> ops;
  SavedVariable residual_out, weight;
  double eps = 0;
  bool leaf_inputs = false;

  variable_list apply(variable_list&& grads) override {
    const bool need_in = task_should_compute_output(0), need_res = task_should_compute_output(1);
    if (!grads[0].defined()) {
      // Only residual_out (input + residual) was used: its gradient is theirs, and the weight gets none, as
      // with torch's add and rms_norm (an optimizer skips a None gradient; it would step a zero one). The
      // identity needs no double backward.
      return {need_in ? grads[1] : Tensor(), need_res ? grads[1] : Tensor(), Tensor()};
    }
    const Tensor h = residual_out.unpack(getptr()), w = weight.unpack();
    const Tensor& grad_out = grads[0];
    const std::optional<Tensor> grad_res = defined_or_none(grads[1]);  // residual_out unused: none
    Tensor gi, gr, gw;
    if (need_in && need_res && leaf_inputs) {
      std::tie(gi, gr, gw) = below(ops->backward_two, grad_out, grad_res, h, w, eps);
    } else {
      std::tie(gi, gw) = below(ops->backward, grad_out, grad_res, h, w, eps);
      gr = gi;
    }
    return once_differentiable(
        "fused_add_rmsnorm", {need_in ? gi : Tensor(), need_res ? gr : Tensor(), task_should_compute_output(2) ? gw : Tensor()},
        {grads[0], grads[1], h, w});
  }
  std::string name() const override { return "opbuilder::FusedAddRMSNormBackward"; }
  void release_variables() override {
    residual_out.reset_data();
    weight.reset_data();
  }
};

struct RmsBackward final : torch::autograd::Node {
  std::shared_ptr<const Ops> ops;
  SavedVariable input, weight;
  double eps = 0;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {Tensor(), Tensor()};
    const Tensor x = input.unpack(), w = weight.unpack();
    auto [gi, gw] = below(ops->backward, grads[0], std::nullopt, x, w, eps);
    return once_differentiable(
        "rms_norm", {task_should_compute_output(0) ? gi : Tensor(), task_should_compute_output(1) ? gw : Tensor()},
        {grads[0], x, w});
  }
  std::string name() const override { return "opbuilder::RMSNormBackward"; }
  void release_variables() override {
    input.reset_data();
    weight.reset_data();
  }
};

// The Autograd kernels, with `fused` and `rms` the ops run below autograd (the nograd overloads for the
// .grad ones, the registered ops themselves for theirs).
inline auto fused_kernel(std::shared_ptr<const Ops> ops, c10::TypedOperatorHandle<Fused> fused) {
  return [ops, fused](const Tensor& input, const Tensor& residual, const Tensor& weight,
                      double eps) -> std::tuple<Tensor, Tensor> {
    auto [out, h] = below(fused, input, residual, weight, eps);
    if (torch::autograd::compute_requires_grad(input, residual, weight)) {
      auto node = make_node<FusedBackward>(input, residual, weight);
      node->ops = ops;
      node->eps = eps;
      node->leaf_inputs = input.is_leaf() && residual.is_leaf();
      set_grad_fn({out, h}, node);
      // Saved in the Python path's order (residual_out, weight): a checkpoint recorded on one path and
      // recomputed on the other (the glue's first build) matches the saved tensors by position.
      node->residual_out = SavedVariable(h, true);
      node->weight = SavedVariable(weight, false);
    }
    return {out, h};
  };
}

inline auto rms_kernel(std::shared_ptr<const Ops> ops, c10::TypedOperatorHandle<Rms> rms) {
  return [ops, rms](const Tensor& input, const Tensor& weight, double eps) -> Tensor {
    Tensor out = below(rms, input, weight, eps);
    if (torch::autograd::compute_requires_grad(input, weight)) {
      auto node = make_node<RmsBackward>(input, weight);
      node->ops = ops;
      node->input = SavedVariable(savable(input), false);
      node->weight = SavedVariable(weight, false);
      node->eps = eps;
      set_grad_fn({out}, node);
    }
    return out;
  };
}

inline std::shared_ptr<const Ops> find_ops(const Registrar& r) {
  return std::make_shared<const Ops>(Ops{
      find<Fused>(r.ns, "fused_add_rmsnorm", "nograd"), find<Rms>(r.ns, "rms_norm", "nograd"),
      find<BackwardOp>(r.ns, "fused_add_rmsnorm_backward", ""),
      find<BackwardTwo>(r.ns, "fused_add_rmsnorm_backward", "two_grads")});
}

inline std::vector<std::string> bind_registered(Registrar& r) {
  auto ops = find_ops(r);
  auto fused = fused_kernel(ops, find<Fused>(r.ns, "fused_add_rmsnorm", ""));
  auto rms = rms_kernel(ops, find<Rms>(r.ns, "rms_norm", ""));
  r.lib.impl("fused_add_rmsnorm", torch::dispatch(c10::DispatchKey::Autograd,
                                                  [fused](const Tensor& input, const Tensor& residual,
                                                          const Tensor& weight, double eps) {
                                                    no_forward_ad("fused_add_rmsnorm", input, residual, weight);
                                                    return fused(input, residual, weight, eps);
                                                  }));
  r.lib.impl("rms_norm", torch::dispatch(c10::DispatchKey::Autograd,
                                         [rms](const Tensor& input, const Tensor& weight, double eps) {
                                           no_forward_ad("rms_norm", input, weight);
                                           return rms(input, weight, eps);
                                         }));
  return {"fused_add_rmsnorm", "rms_norm"};
}

inline void bind(Registrar& r) {
  auto ops = find_ops(r);
  r.lib.def("fused_add_rmsnorm.grad(Tensor input, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  r.lib.impl("fused_add_rmsnorm.grad", torch::dispatch(c10::DispatchKey::Autograd, fused_kernel(ops, ops->fused)));
  r.lib.def("rms_norm.grad(Tensor input, Tensor weight, float eps) -> Tensor");
  r.lib.impl("rms_norm.grad", torch::dispatch(c10::DispatchKey::Autograd, rms_kernel(ops, ops->rms)));
}

}  // namespace opb::autograd::fused_add_rmsnorm
