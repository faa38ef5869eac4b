// relu's C++ gradient path (kernels/autograd/autograd.h): relu.grad(x) -> y runs relu_mask below autograd
// and keeps its sign bits for the backward, which reads them in relu_mask_backward.
#pragma once

#include <autograd/autograd.h>

namespace opb::autograd::relu {

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

inline void bind(Registrar& r) {
  auto ops = std::make_shared<const Ops>(Ops{find<Mask>(r.ns, "relu_mask", "nograd"),
                                             find<MaskBackward>(r.ns, "relu_mask_backward", "")});
  r.lib.def("relu.grad(Tensor x) -> Tensor");
  r.lib.impl("relu.grad", torch::dispatch(c10::DispatchKey::Autograd, [ops](const Tensor& x) -> Tensor {
               auto [y, mask] = below(ops->mask, x);
               if (torch::autograd::compute_requires_grad(x)) {
                 auto node = make_node<Backward>(x);
                 node->ops = ops;
                 node->mask = SavedVariable(mask, false);
                 set_grad_fn({y}, node);
               }
               return y;
             }));
}

}  // namespace opb::autograd::relu
