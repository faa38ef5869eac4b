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

// For backwards whose own backward (double backward) the op does not have: a clear error rather than
// a gradient that silently misses a term.
inline void no_double_backward(const char* op) {
  TORCH_CHECK(!torch::autograd::GradMode::is_enabled(), op,
              ": double backward (backward with create_graph=True) is not supported by this op; take the "
              "gradient once, or use the unfused PyTorch ops for higher-order gradients");
}

// How torch owns a Node: std::shared_ptr up to torch 2.12, c10::intrusive_ptr since.
using NodePtr = decltype(std::declval<torch::autograd::Node&>().getptr());
constexpr bool kSharedNodes = std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;

// Makes a Node of type N, owned as torch owns Nodes, and connects it to `inputs` (undefined tensors get
// no edge).
template <class N, class... Inputs>
auto make_node(const Inputs&... inputs) {
  auto node = [] {
    if constexpr (kSharedNodes) {
      // deleteNode (found by argument-dependent lookup: it exists only where Nodes are shared) frees a long
      // chain of Nodes without deep recursion.
      return std::shared_ptr<N>(new N(), [](N* p) { deleteNode(p); });
    } else {
      return c10::make_intrusive<N>();
    }
  }();
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

// What `bind` registers: one FRAGMENT library a loaded op namespace, kept for the process's life.
struct Registrar {
  std::string ns;
  torch::Library& lib;
};

}  // namespace opb::autograd
