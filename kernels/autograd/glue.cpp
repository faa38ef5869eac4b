// The C++ gradient path of the built-in ops (autograd.h says what and why). One library for all of them,
// built once per torch version; Python binds each loaded op to it:
//   bind(str op, str ns) -> ()   adds `<op>.grad` overloads, with their Autograd kernels, to the op's
//                                namespace `ns` (ns::relu.grad, ns::forward.grad, ...): the eager path's
//   bind_registered(str op, str ns) -> str[]
//                                gives the op's registered overloads (ns::relu, ns::relu_mask, ...) their
//                                Autograd kernels; returns their names (the formulas Python need not register)
#include <opbuilder/library.h>

#include <functional>
#include <list>
#include <map>
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
using BindRegisteredFn = std::vector<std::string> (*)(opb::autograd::Registrar&);

struct Binders {
  BindFn grad;
  BindRegisteredFn registered;
};

Binders binders(const std::string& op) {
  namespace ag = opb::autograd;
  if (op == "relu") return {&ag::relu::bind, &ag::relu::bind_registered};
  if (op == "softmax") return {&ag::softmax::bind, &ag::softmax::bind_registered};
  if (op == "fused_relu_layernorm") return {&ag::fused_relu_layernorm::bind, &ag::fused_relu_layernorm::bind_registered};
  if (op == "fused_add_rmsnorm") return {&ag::fused_add_rmsnorm::bind, &ag::fused_add_rmsnorm::bind_registered};
  if (op == "fused_matmul_add_relu") return {&ag::fused_matmul_add_relu::bind, &ag::fused_matmul_add_relu::bind_registered};
  TORCH_CHECK(false, "opbuilder autograd: no C++ gradient path for an op named '", op,
              "'; known: relu, softmax, fused_relu_layernorm, fused_add_rmsnorm, fused_matmul_add_relu");
  return {nullptr, nullptr};
}

// The libraries bind() and bind_registered() made: registrations last as long as their Library, so for the
// process's life. `bound`: "<what>/<op>/<ns>" -> the names bind_registered returned.
std::mutex mutex;
std::list<torch::Library> libraries;
std::map<std::string, std::vector<std::string>> bound;

std::vector<std::string> once(const char* what, const std::string& op, const std::string& ns,
                              const std::function<std::vector<std::string>(opb::autograd::Registrar&)>& fn) {
  std::lock_guard<std::mutex> lock(mutex);
  const std::string key = std::string(what) + "/" + op + "/" + ns;
  if (auto it = bound.find(key); it != bound.end()) return it->second;  // a second LazyOps of the same build
  torch::Library& lib = libraries.emplace_back(torch::Library::FRAGMENT, ns, std::nullopt, __FILE__, __LINE__);
  opb::autograd::Registrar r{ns, lib};
  return bound[key] = fn(r);
}

void bind(const std::string& op, const std::string& ns) {
  const BindFn fn = binders(op).grad;
  once("grad", op, ns, [fn](opb::autograd::Registrar& r) {
    fn(r);
    return std::vector<std::string>{};
  });
}

std::vector<std::string> bind_registered(const std::string& op, const std::string& ns) {
  return once("registered", op, ns, binders(op).registered);
}

}  // namespace

OPB_LIBRARY(m) {
  m.def("bind(str op, str ns) -> ()", &bind);
  m.def("bind_registered(str op, str ns) -> str[]", &bind_registered);
}
