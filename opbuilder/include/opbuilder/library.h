// Registering ops under the namespace opbuilder gives each build: opb_<op>_<key12>, so two versions
// of one op load side by side in one process.
//
//   OPB_LIBRARY(m) { m.def("relu(Tensor x) -> Tensor"); }
//   OPB_LIBRARY_IMPL(CPU, m) { m.impl("relu", TORCH_BOX(&relu_cpu)); }     // stable ABI
//   OPB_LIBRARY_IMPL(CPU, m) { m.impl("relu", &relu_cpu); }                // classic (torch/library.h)
//
// A JIT build compiles the namespace into one generated file (opb_build_namespace()), not into a flag,
// so a new key recompiles that file alone. An install-time build passes -DOPB_NAMESPACE=<name> instead.
// With -DOPB_STABLE_ABI (added by the builder for ops written on <opbuilder/stable.h>) the macros
// register through the LibTorch stable ABI; otherwise through torch/library.h.
#pragma once

#ifdef OPB_STABLE_ABI
#include <torch/csrc/stable/library.h>
#else
#include <torch/library.h>
#endif

#define OPB_CONCAT_INNER_(a, b) a##b
#define OPB_CONCAT_(a, b) OPB_CONCAT_INNER_(a, b)
#define OPB_STRINGIZE_INNER_(x) #x
#define OPB_STRINGIZE_(x) OPB_STRINGIZE_INNER_(x)

#ifdef OPB_NAMESPACE
#define OPB_NAMESPACE_NAME_() OPB_STRINGIZE_(OPB_NAMESPACE)
#else
// Defined in the build's generated file; hidden, so that each loaded library sees its own.
extern "C" __attribute__((visibility("hidden"))) const char* opb_build_namespace();
#define OPB_NAMESPACE_NAME_() opb_build_namespace()
#endif

#ifdef OPB_STABLE_ABI
#define OPB_LIBRARY_INIT_(kind, key, m, uid)                                                             \
  static void OPB_CONCAT_(opb_library_init_, uid)(torch::stable::detail::StableLibrary&);               \
  static const torch::stable::detail::StableTorchLibraryInit OPB_CONCAT_(opb_library_static_init_, uid)( \
      torch::stable::detail::StableLibrary::Kind::kind, &OPB_CONCAT_(opb_library_init_, uid),           \
      OPB_NAMESPACE_NAME_(), key, __FILE__, __LINE__);                                                   \
  void OPB_CONCAT_(opb_library_init_, uid)(torch::stable::detail::StableLibrary & m)
#define OPB_LIBRARY(m) OPB_LIBRARY_INIT_(DEF, nullptr, m, __COUNTER__)
#define OPB_LIBRARY_IMPL(k, m) OPB_LIBRARY_INIT_(IMPL, #k, m, __COUNTER__)
#else
#define OPB_LIBRARY_INIT_(kind, key, m, uid)                                                                   \
  static void OPB_CONCAT_(opb_library_init_, uid)(torch::Library&);                                           \
  static const torch::detail::TorchLibraryInit OPB_CONCAT_(opb_library_static_init_, uid)(                    \
      torch::Library::kind, &OPB_CONCAT_(opb_library_init_, uid), OPB_NAMESPACE_NAME_(), key, __FILE__, __LINE__); \
  void OPB_CONCAT_(opb_library_init_, uid)(torch::Library & m)
#define OPB_LIBRARY(m) OPB_LIBRARY_INIT_(DEF, std::nullopt, m, __COUNTER__)
#define OPB_LIBRARY_IMPL(k, m) OPB_LIBRARY_INIT_(IMPL, std::make_optional(c10::DispatchKey::k), m, __COUNTER__)
#endif
