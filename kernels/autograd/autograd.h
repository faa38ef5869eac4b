// The C++ gradient path of the built-in ops: what every op's <op>_autograd.h builds on.
//
// The ops themselves are built once on the LibTorch stable ABI, which has no autograd API: their kernels
// are boxed functions behind the dispatcher. This glue, built once per torch version (it includes torch's
// classic headers, so its key carries the exact torch), adds to each loaded op one overload,
// `<op>.grad`, whose Autograd kernel records the call as aten's generated kernels do: run the op's
// forward below autograd, then, if an input needs a gradient, one Node with its saved tensors and the
// next edges. The backward is that Node's apply(): one C++ call into the op's backward kernel. Neither
// direction runs Python, and nothing a call needs is looked up per call: the ops' dispatcher handles
// are found once, when the overload is bound (`bind`).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace opb::autograd {

using at::Tensor;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// One op's dispatcher entry, typed; found once when the overload is bound.
template <class Sig>
c10::TypedOperatorHandle<Sig> find(const std::string& ns, const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + name).c_str(), overload).template typed<Sig>();
}

// Calls `op` with the Autograd keys excluded, as aten's VariableType kernels call the next kernel: the
// op's own (stable, boxed) CPU or CUDA kernel runs, and nothing is recorded.
template <class Sig, class... Args>
auto below(const c10::TypedOperatorHandle<Sig>& op, Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(std::forward<Args>(args)...);
}

// A backward's call of another op: below autograd, unless the backward itself is recorded
// (create_graph=True), where the op's registered autograd formula must see it.
template <class Sig, class... Args>
auto in_backward(const c10::TypedOperatorHandle<Sig>& op, Args&&... args) {
  if (torch::autograd::GradMode::is_enabled()) return op.call(std::forward<Args>(args)...);
  return below(op, std::forward<Args>(args)...);
}

// The registered overloads reach forward-mode AD (the eager path never does): no formula for a tangent
// here, so a dual input is refused, as aten refuses it for ops without one, rather than losing its tangent.
template <class... Inputs>
void no_forward_ad(const char* op, const Inputs&... inputs) {
  const bool dual = (... || (inputs.defined() && inputs._fw_grad(/*level=*/0).defined()));
  TORCH_CHECK_NOT_IMPLEMENTED(!dual, "Trying to use forward AD with opbuilder's ", op,
                              ", which does not support it (no forward-mode formula)");
}

// The error a second-order gradient through an op without a double backward raises.
inline std::string double_backward_error(const char* op) {
  return std::string(op) +
         ": double backward (a gradient of this op's gradient) is not supported by this op; take the gradient "
         "once, or use the unfused PyTorch ops for higher-order gradients";
}

// How torch owns a Node: std::shared_ptr up to torch 2.12, c10::intrusive_ptr since.
using NodePtr = decltype(std::declval<torch::autograd::Node&>().getptr());
constexpr bool kSharedNodes = std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;

// A new Node of type N made from `args`, owned as torch owns Nodes.
template <class N, class... Args>
auto own_node(Args&&... args) {
  if constexpr (kSharedNodes) {
    // deleteNode (found by argument-dependent lookup: it exists only where Nodes are shared) frees a long
    // chain of Nodes without deep recursion.
    return std::shared_ptr<N>(new N(std::forward<Args>(args)...), [](N* p) { deleteNode(p); });
  } else {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  }
}

// Makes a Node of type N and connects it to `inputs` (undefined tensors get no edge).
template <class N, class... Inputs>
auto make_node(const Inputs&... inputs) {
  auto node = own_node<N>();
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  return node;
}

// Sets `node` as the grad_fn of `outputs`, in order (their output_nr are 0, 1, ...).
template <class Ptr>
void set_grad_fn(std::initializer_list<Tensor> outputs, const Ptr& node) {
  const NodePtr fn(node);
  for (const Tensor& t : outputs) torch::autograd::set_history(t, fn);
}

inline Tensor or_undefined(const std::optional<Tensor>& t) { return t.has_value() ? *t : Tensor(); }

// An input to save for the backward: a copy where it was made under torch.inference_mode (which autograd
// refuses to save), e.g. a frozen encoder's features fed to a norm whose weight trains, as the PyTorch ops a
// norm replaces accept it (they save tensors of their own making).
inline Tensor savable(const Tensor& t) { return t.defined() && t.is_inference() ? t.clone() : t; }

// For backwards whose own backward (double backward) the op does not have, as torch's once_differentiable:
// where the backward is recorded (create_graph=True, or torch.func's transforms, which always record it) its
// results come out with a Node that raises the clear error above when, and only when, a second-order gradient
// reaches it. Its edges are those of `anchors` (the incoming gradients and the saved tensors: what the results
// depend on), so that a second-order gradient asked of the op's inputs reaches it. A first-order gradient taken
// that way works (torch.func.grad, a gradient penalty's value); a second-order one raises rather than silently
// missing a term. Nested torch.func gradient transforms never get here: the kernels run below every level, so
// this Node would reach the innermost level only and an outer one would see a constant; the ops' Python
// functions refuse them (opbuilder/torchop/once.py).
inline variable_list once_differentiable(const char* op, variable_list&& results, const variable_list& anchors) {
  if (!torch::autograd::GradMode::is_enabled()) return std::move(results);
  const NodePtr fn(own_node<torch::autograd::Error>(double_backward_error(op), torch::autograd::collect_next_edges(anchors)));
  for (Tensor& r : results) {
    if (r.defined()) {
      r = r.detach();  // its own output slot, also where two results are one tensor
      torch::autograd::set_history(r, fn);
    }
  }
  return std::move(results);
}

// What `bind` registers: one FRAGMENT library a loaded op namespace, kept for the process's life.
struct Registrar {
  std::string ns;
  torch::Library& lib;
};

}  // namespace opb::autograd
