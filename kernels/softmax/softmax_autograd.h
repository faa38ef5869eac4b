// softmax's C++ gradient path (kernels/autograd/autograd.h): forward.grad(x) -> y over the last dim; the
// backward reads y. The registered overloads (bind_registered): forward as forward.grad; backward (y,
// grad_y) with the double backward of ops/softmax.py.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/ops/sum.h>

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

// The forward's Autograd kernel, for forward.grad (below it the nograd overload) and the registered
// forward (below it itself).
inline auto forward_kernel(std::shared_ptr<const Ops> ops, c10::TypedOperatorHandle<Forward> forward) {
  return [ops, forward](const Tensor& x) -> Tensor {
    Tensor y = below(forward, x);
    if (torch::autograd::compute_requires_grad(x)) {
      auto node = make_node<Backward>(x);
      node->ops = ops;
      set_grad_fn({y}, node);
      node->y = SavedVariable(y, true);  // an output: saved after its history is set, as aten does
    }
    return y;
  };
}

// The backward op's backward. grad_x = y * (g - s), s = sum(g * y). For an upstream v:
//   d/dg = y * (v - sum(v * y)) = backward(y, v);  d/dy = v * (g - s) - g * sum(v * y), in float32 (float64 kept).
struct BackwardBackward final : torch::autograd::Node {
  std::shared_ptr<const Ops> ops;
  SavedVariable y, g;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {Tensor(), Tensor()};
    const Tensor y_ = y.unpack(), g_ = g.unpack(), v = grads[0].to(y_.scalar_type());
    Tensor grad_g = task_should_compute_output(1) ? in_backward(ops->backward, y_, v) : Tensor();
    Tensor grad_y;
    if (task_should_compute_output(0)) {
      const auto acc = y_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      const Tensor y32 = y_.to(acc), g32 = g_.to(acc), v32 = v.to(acc);
      const Tensor s = at::sum(g32 * y32, -1, true);
      grad_y = (v32 * (g32 - s) - g32 * at::sum(v32 * y32, -1, true)).to(y_.scalar_type());
    }
    return {grad_y, grad_g};
  }
  std::string name() const override { return "opbuilder::SoftmaxBackwardBackward"; }
  void release_variables() override {
    y.reset_data();
    g.reset_data();
  }
};

inline std::vector<std::string> bind_registered(Registrar& r) {
  const auto forward = find<Forward>(r.ns, "forward", "");
  auto ops = std::make_shared<const Ops>(Ops{forward, find<BackwardOp>(r.ns, "backward", "")});
  auto forward_ = forward_kernel(ops, forward);
  r.lib.impl("forward", torch::dispatch(c10::DispatchKey::Autograd, [forward_](const Tensor& x) -> Tensor {
               no_forward_ad("softmax", x);
               return forward_(x);
             }));
  r.lib.impl("backward", torch::dispatch(c10::DispatchKey::Autograd, [ops](const Tensor& y, const Tensor& grad_y) -> Tensor {
               no_forward_ad("softmax's backward", y, grad_y);
               Tensor grad_x = below(ops->backward, y, grad_y);
               if (torch::autograd::compute_requires_grad(y, grad_y)) {
                 auto node = make_node<BackwardBackward>(y, grad_y);
                 node->ops = ops;
                 node->y = SavedVariable(y, false);
                 node->g = SavedVariable(grad_y, false);
                 set_grad_fn({grad_x}, node);
               }
               return grad_x;
             }));
  return {"forward", "backward"};
}

inline void bind(Registrar& r) {
  auto ops = std::make_shared<const Ops>(Ops{find<Forward>(r.ns, "forward", "nograd"),
                                             find<BackwardOp>(r.ns, "backward", "")});
  r.lib.def("forward.grad(Tensor x) -> Tensor");
  r.lib.impl("forward.grad", torch::dispatch(c10::DispatchKey::Autograd, forward_kernel(ops, ops->forward)));
}

}  // namespace opb::autograd::softmax
