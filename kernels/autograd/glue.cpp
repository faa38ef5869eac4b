// The C++ gradient path of the built-in ops (autograd.h says what and why). One library for all of them,
// built once per torch version; Python binds each loaded op to it:
//   bind(str op, str ns) -> ()   adds `<op>.grad` overloads, with their Autograd kernels, to the op's
//                                namespace `ns` (ns::relu.grad, ns::forward.grad, ...)
#include <opbuilder/library.h>

#include <list>
#include <mutex>
#include <string>

#include "autograd.h"
#include "fused_add_rmsnorm/fused_add_rmsnorm_autograd.h"
#include "fused_matmul_add_relu/fused_matmul_add_relu_autograd.h"
#include "fused_relu_layernorm/fused_relu_layernorm_autograd.h"
#include "relu/relu_autograd.h"
#include "softmax/softmax_autograd.h"

namespace {

using BindFn = void (*)(opb::autograd::Registrar&);

BindFn binder(const std::string& op) {
  namespace ag = opb::autograd;
  if (op == "relu") return &ag::relu::bind;
  if (op == "softmax") return &ag::softmax::bind;
  if (op == "fused_relu_layernorm") return &ag::fused_relu_layernorm::bind;
  if (op == "fused_add_rmsnorm") return &ag::fused_add_rmsnorm::bind;
  if (op == "fused_matmul_add_relu") return &ag::fused_matmul_add_relu::bind;
  return nullptr;
}

// The libraries bind() made: registrations last as long as their Library, so for the process's life.
std::mutex mutex;
std::list<torch::Library> libraries;
std::list<std::string> bound;

void bind(const std::string& op, const std::string& ns) {
  const BindFn fn = binder(op);
  TORCH_CHECK(fn != nullptr, "opbuilder autograd: no C++ gradient path for an op named '", op,
              "'; known: relu, softmax, fused_relu_layernorm, fused_add_rmsnorm, fused_matmul_add_relu");
  std::lock_guard<std::mutex> lock(mutex);
  const std::string key = op + "/" + ns;
  for (const std::string& done : bound)
    if (done == key) return;  // bound already (a second LazyOps of the same build)
  torch::Library& lib = libraries.emplace_back(torch::Library::FRAGMENT, ns, std::nullopt, __FILE__, __LINE__);
  opb::autograd::Registrar r{ns, lib};
  fn(r);
  bound.push_back(key);
}

}  // namespace

OPB_LIBRARY(m) { m.def("bind(str op, str ns) -> ()", &bind); }
