// relu's C++ gradient path (kernels/autograd/autograd.h): relu.grad(x) -> y runs relu_mask below autograd
// and keeps its sign bits for the backward, which reads them in relu_mask_backward. The registered
// overloads (bind_registered) take ops/relu.py's formulas: relu from y (threshold_backward, what a DTensor
// needs: the bits follow only an x split on dim 0), relu_mask from its bits, relu_mask_backward linear.
#pragma once

#include <ATen/ops/threshold_backward.h>

#include <autograd/autograd.h>

namespace opb::autograd::relu {

using Plain = Tensor(const Tensor&);
using Mask = std::tuple<Tensor, Tensor>(const Tensor&);
using MaskBackward = Tensor(const Tensor&, const Tensor&);

struct Ops {
  c10::TypedOperatorHandle<Mask> mask;
  c10::TypedOperatorHandle<MaskBackward> mask_backward;
};

struct Backward final : torch::autograd::Node {
  std::shared_ptr<const Ops> ops;
  SavedVariable mask;

  variable_list apply(variable_list&& grads) override {
    // relu_mask_backward is linear in grad_y with its own autograd formula: double backward works.
    if (!grads[0].defined() || !task_should_compute_output(0)) return {Tensor()};
    return {in_backward(ops->mask_backward, grads[0], mask.unpack())};
  }
  std::string name() const override { return "opbuilder::ReluBackward"; }
  void release_variables() override { mask.reset_data(); }
};

// Records `out` as made from `input` through the sign bits `bits`, if `input` needs a gradient: its backward
// is relu_mask_backward with those bits (relu's and relu_mask's forward; relu_mask_backward, linear in grad_y,
// the same for its own backward).
inline void keep_bits(const std::shared_ptr<const Ops>& ops, const Tensor& input, const Tensor& bits, const Tensor& out) {
  if (!torch::autograd::compute_requires_grad(input)) return;
  auto node = make_node<Backward>(input);
  node->ops = ops;
  node->mask = SavedVariable(bits, false);
  set_grad_fn({out}, node);
}

// relu's registered backward: from y, as torch.relu's.
struct FromY final : torch::autograd::Node {
  SavedVariable y;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined() || !task_should_compute_output(0)) return {Tensor()};
    return {at::threshold_backward(grads[0], y.unpack(getptr()), 0)};
  }
  std::string name() const override { return "opbuilder::ReluBackward"; }
  void release_variables() override { y.reset_data(); }
};

inline std::vector<std::string> bind_registered(Registrar& r) {
  const auto relu = find<Plain>(r.ns, "relu", "");
  const auto mask = find<Mask>(r.ns, "relu_mask", "");
  auto ops = std::make_shared<const Ops>(Ops{mask, find<MaskBackward>(r.ns, "relu_mask_backward", "")});
  r.lib.impl("relu", torch::dispatch(c10::DispatchKey::Autograd, [relu](const Tensor& x) -> Tensor {
               no_forward_ad("relu", x);
               Tensor y = below(relu, x);
               if (torch::autograd::compute_requires_grad(x)) {
                 auto node = make_node<FromY>(x);
                 set_grad_fn({y}, node);
                 node->y = SavedVariable(y, true);
               }
               return y;
             }));
  r.lib.impl("relu_mask", torch::dispatch(c10::DispatchKey::Autograd, [ops](const Tensor& x) -> std::tuple<Tensor, Tensor> {
               no_forward_ad("relu_mask", x);
               auto [y, bits] = below(ops->mask, x);
               keep_bits(ops, x, bits, y);  // the bits are not differentiable: no history
               return {y, bits};
             }));
  // Linear in grad_y with the same bits: its backward is itself (what makes relu's double backward).
  r.lib.impl("relu_mask_backward",
             torch::dispatch(c10::DispatchKey::Autograd, [ops](const Tensor& grad_y, const Tensor& bits) -> Tensor {
               no_forward_ad("relu_mask_backward", grad_y);
               Tensor grad_x = below(ops->mask_backward, grad_y, bits);
               keep_bits(ops, grad_y, bits, grad_x);
               return grad_x;
             }));
  return {"relu", "relu_mask", "relu_mask_backward"};
}

inline void bind(Registrar& r) {
  auto ops = std::make_shared<const Ops>(Ops{find<Mask>(r.ns, "relu_mask", "nograd"),
                                             find<MaskBackward>(r.ns, "relu_mask_backward", "")});
  r.lib.def("relu.grad(Tensor x) -> Tensor");
  r.lib.impl("relu.grad", torch::dispatch(c10::DispatchKey::Autograd, [ops](const Tensor& x) -> Tensor {
               auto [y, bits] = below(ops->mask, x);
               keep_bits(ops, x, bits, y);
               return y;
             }));
}

}  // namespace opb::autograd::relu
