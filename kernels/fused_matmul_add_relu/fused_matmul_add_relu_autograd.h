// fused_matmul_add_relu's C++ gradient path (kernels/autograd/autograd.h):
// fused_matmul_add_relu.grad(lhs, rhs, bias?) -> y. The backward: relu's mask from the saved y, then the
// GEMMs of matmul's backward, summed over broadcast dims. In the linear layer's case (2-D, a [N] bias whose
// gradient is wanted, no graph of the backward recorded, and where one_pass() below says it pays) the mask
// and the bias's gradient come from one pass of the op's relu_bias_backward; otherwise ATen's
// threshold_backward and sum, whose own formulas give double backward and whose rules serve tensor subclasses
// (DTensor, and the fake tensors torch.compile traces with, where Inductor fuses them itself). The registered overload
// (bind_registered) gets the same kernel, with the op itself below autograd.
#pragma once

#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/threshold_backward.h>

#include <optional>
#include <tuple>

#include <autograd/autograd.h>

namespace opb::autograd::fused_matmul_add_relu {

using Opt = const std::optional<Tensor>&;
using Forward = Tensor(const Tensor&, const Tensor&, Opt);
using ReluBias = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&);

// Whether `t` is a plain tensor: not a Python subclass (a DTensor, a fake or functional tensor, ...) and not
// wrapped by a vmap, functorch's or the legacy one that autograd.grad(is_grads_batched=True) uses (Batched):
// their fallbacks would run the op one sample at a time, where ATen's ops have batching rules.
inline bool plain(const Tensor& t) {
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Batched});
  return !t.key_set().has_any(wrapped);
}

// Where relu_bias_backward's one pass is taken in the linear layer's 2-D case: CUDA tensors, contiguous (else
// the op would copy them first), plain, and rows of at least 256 bytes: narrower rows leave most of a warp
// idle, and ATen's two ops were faster there (H100, benchmarks/tuning/relu_bias_probe.py: 16384 x 64 bf16,
// 128-byte rows, 19.0 against 17.6 us; 256-byte rows 0.67x ATen's in bf16, 0.92x in fp32). The CPU keeps
// ATen's ops: vectorised and threaded, they beat the op's CPU kernel.
constexpr int64_t kOnePassMinRowBytes = 256;

inline bool one_pass(const Tensor& g, const Tensor& out) {
  return g.is_cuda() && g.sizes() == out.sizes() && g.is_contiguous() && out.is_contiguous() && plain(g) &&
         plain(out) && out.size(1) * static_cast<int64_t>(out.element_size()) >= kOnePassMinRowBytes;
}

inline Tensor reduce_to(const Tensor& grad, c10::IntArrayRef shape) {
  return grad.sizes() == shape ? grad : grad.sum_to_size(shape);
}

// rhs a transposed view (the layer's weight.t()): a gradient of that layout accumulates into the weight without
// a copy.
inline bool transposed(c10::IntArrayRef strides) {
  const size_t d = strides.size();
  return strides[d - 2] == 1 && strides[d - 1] != 1;
}

// rhs's gradient from lhs, rhs's sizes and whether rhs is transposed (rhs itself is not kept where lhs needs no
// gradient). A batch of rhs's own, or lhs's batch of one against rhs's: batched GEMMs (a batch of one flattened
// would be a view DTensor refuses where that dim is split across ranks).
inline Tensor grad_rhs(const Tensor& grad_pre, const Tensor& lhs, c10::IntArrayRef rhs_sizes, bool rhs_transposed) {
  if (rhs_sizes.size() == 3 && (rhs_sizes[0] != 1 || (lhs.dim() == 3 && lhs.size(0) == 1))) {
    return reduce_to(at::matmul(lhs.mT(), grad_pre), rhs_sizes);
  }
  // One rhs shared by every batch entry: the sum over the batch is one GEMM over all rows (flatten, not
  // reshape({-1, k}): that refuses a tensor of 0 elements where K or N is 0; a 2-D lhs is kept as it is).
  Tensor lhs2 = lhs.flatten(0, -2), grad2 = grad_pre.flatten(0, -2);
  Tensor grad = rhs_transposed ? at::matmul(grad2.mT(), lhs2).mT() : at::matmul(lhs2.mT(), grad2);
  return grad.reshape(rhs_sizes);
}

struct Backward final : torch::autograd::Node {
  // As aten's addmm: lhs is kept only where rhs needs a gradient, rhs only where lhs does (a frozen weight does
  // not keep the layer's input alive); their shapes, and whether rhs is transposed, always.
  SavedVariable lhs, rhs, y;
  std::vector<int64_t> lhs_sizes, rhs_sizes, bias_shape;
  bool has_bias = false, rhs_transposed = false;
  std::optional<c10::TypedOperatorHandle<ReluBias>> relu_bias;  // set by kernel(): handles have no default

  variable_list apply(variable_list&& grads) override {
    // With create_graph, every step is an ATen op with its own formula: double backward works.
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    Tensor a = lhs.unpack(), b = rhs.unpack(), out = y.unpack(getptr());
    const bool need_a = task_should_compute_output(0), need_b = task_should_compute_output(1);
    const bool need_c = has_bias && task_should_compute_output(2);
    const Tensor& g = grads[0];
    if (lhs_sizes.size() == 2 && rhs_sizes.size() == 2) {
      // The linear layer's case, as aten's AddmmBackward does it: two mm and a column sum, no matmul or
      // sum_to_size (composites that cost several dispatches each).
      Tensor grad_pre, gc;
      if (need_c && bias_shape.size() == 1 && bias_shape[0] == out.size(1) && one_pass(g, out) &&
          !torch::autograd::GradMode::is_enabled()) {
        std::tie(grad_pre, gc) = below(*relu_bias, g, out);
      } else {
        grad_pre = at::threshold_backward(g, out, 0);
        if (need_c) gc = bias_shape.size() == 1 && bias_shape[0] == grad_pre.size(1) ? at::sum(grad_pre, 0)
                                                                                     : reduce_to(grad_pre, bias_shape);
      }
      Tensor ga = need_a ? at::mm(grad_pre, b.t()) : Tensor();
      Tensor gb;
      if (need_b) gb = rhs_transposed ? at::mm(grad_pre.t(), a).t() : at::mm(a.t(), grad_pre);
      return {ga, gb, gc};
    }
    Tensor grad_pre = at::threshold_backward(g, out, 0);
    Tensor ga = need_a ? reduce_to(at::matmul(grad_pre, b.mT()), lhs_sizes) : Tensor();
    Tensor gb = need_b ? grad_rhs(grad_pre, a, rhs_sizes, rhs_transposed) : Tensor();
    Tensor gc = need_c ? reduce_to(grad_pre, bias_shape) : Tensor();
    return {ga, gb, gc};
  }
  std::string name() const override { return "opbuilder::FusedMatmulAddReluBackward"; }
  void release_variables() override {
    lhs.reset_data();
    rhs.reset_data();
    y.reset_data();
  }
};

// The Autograd kernel, with `forward` the op run below autograd (the nograd overload for .grad, the
// registered op itself for its own).
inline auto kernel(c10::TypedOperatorHandle<Forward> forward, c10::TypedOperatorHandle<ReluBias> relu_bias) {
  return [forward, relu_bias](const Tensor& lhs, const Tensor& rhs, Opt bias) -> Tensor {
    Tensor y = below(forward, lhs, rhs, bias);
    const Tensor c = or_undefined(bias);
    if (torch::autograd::compute_requires_grad(lhs, rhs, c)) {
      auto node = make_node<Backward>(lhs, rhs, c);
      if (torch::autograd::compute_requires_grad(rhs)) node->lhs = SavedVariable(lhs, false);
      if (torch::autograd::compute_requires_grad(lhs)) node->rhs = SavedVariable(rhs, false);
      node->lhs_sizes = lhs.sizes().vec();
      node->rhs_sizes = rhs.sizes().vec();
      node->rhs_transposed = transposed(rhs.strides());
      node->has_bias = c.defined();
      node->relu_bias = relu_bias;
      if (c.defined()) node->bias_shape = c.sizes().vec();
      set_grad_fn({y}, node);
      node->y = SavedVariable(y, true);
    }
    return y;
  };
}

inline std::vector<std::string> bind_registered(Registrar& r) {
  r.lib.impl("fused_matmul_add_relu",
             torch::dispatch(c10::DispatchKey::Autograd,
                             [k = kernel(find<Forward>(r.ns, "fused_matmul_add_relu", ""),
                                         find<ReluBias>(r.ns, "relu_bias_backward", ""))](
                                 const Tensor& lhs, const Tensor& rhs, Opt bias) {
                               no_forward_ad("fused_matmul_add_relu", lhs, rhs, or_undefined(bias));
                               return k(lhs, rhs, bias);
                             }));
  return {"fused_matmul_add_relu"};
}

inline void bind(Registrar& r) {
  r.lib.def("fused_matmul_add_relu.grad(Tensor lhs, Tensor rhs, Tensor? bias) -> Tensor");
  r.lib.impl("fused_matmul_add_relu.grad",
             torch::dispatch(c10::DispatchKey::Autograd,
                             kernel(find<Forward>(r.ns, "fused_matmul_add_relu", "nograd"),
                                    find<ReluBias>(r.ns, "relu_bias_backward", ""))));
}

}  // namespace opb::autograd::fused_matmul_add_relu
