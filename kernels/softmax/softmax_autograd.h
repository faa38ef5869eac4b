// softmax's C++ gradient path (kernels/autograd/autograd.h): forward.grad(x) -> y over the last dim; the
// backward reads y.
#pragma once

#include <autograd/autograd.h>

namespace opb::autograd::softmax {

using Forward = Tensor(const Tensor&);
using BackwardOp = Tensor(const Tensor&, const Tensor&);

struct Ops {
  c10::TypedOperatorHandle<Forward> forward;
  c10::TypedOperatorHandle<BackwardOp> backward;
};

struct Backward final : torch::autograd::Node {
  std::shared_ptr<const Ops> ops;
  SavedVariable y;

  variable_list apply(variable_list&& grads) override {
    // The backward op has its own autograd formula (ops/softmax.py): double backward works.
    if (!grads[0].defined() || !task_should_compute_output(0)) return {Tensor()};
    Tensor y_ = y.unpack(getptr());
    return {in_backward(ops->backward, y_, grads[0].to(y_.scalar_type()))};
  }
  std::string name() const override { return "opbuilder::SoftmaxBackward"; }
  void release_variables() override { y.reset_data(); }
};

inline void bind(Registrar& r) {
  auto ops = std::make_shared<const Ops>(Ops{find<Forward>(r.ns, "forward", "nograd"),
                                             find<BackwardOp>(r.ns, "backward", "")});
  r.lib.def("forward.grad(Tensor x) -> Tensor");
  r.lib.impl("forward.grad", torch::dispatch(c10::DispatchKey::Autograd, [ops](const Tensor& x) -> Tensor {
               Tensor y = below(ops->forward, x);
               if (torch::autograd::compute_requires_grad(x)) {
                 auto node = make_node<Backward>(x);
                 node->ops = ops;
                 set_grad_fn({y}, node);
                 node->y = SavedVariable(y, true);  // an output: saved after its history is set, as aten does
               }
               return y;
             }));
}

}  // namespace opb::autograd::softmax
