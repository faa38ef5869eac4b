// Registering ops under the namespace opbuilder gives each build.
//
// The builder passes -DOPB_NAMESPACE=opb_<op>_<key>, so two versions of one op can be loaded in one
// process. TORCH_LIBRARY stringifies its argument, hence the extra expansion step.
#pragma once

#ifndef OPB_NAMESPACE
#error "OPB_NAMESPACE is not defined: build this file through an opbuilder OpBuilder"
#endif

#ifdef OPB_STABLE_ABI  // set by the builder for a binding that includes <opbuilder/stable.h>
#include <torch/csrc/stable/library.h>
#define OPB_LIBRARY_EXPAND_(ns, m) STABLE_TORCH_LIBRARY(ns, m)
#define OPB_LIBRARY_IMPL_EXPAND_(ns, k, m) STABLE_TORCH_LIBRARY_IMPL(ns, k, m)
#else
#include <torch/library.h>
#define OPB_LIBRARY_EXPAND_(ns, m) TORCH_LIBRARY(ns, m)
#define OPB_LIBRARY_IMPL_EXPAND_(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
#endif

// OPB_LIBRARY(m) { m.def("relu(Tensor x) -> Tensor"); }
#define OPB_LIBRARY(m) OPB_LIBRARY_EXPAND_(OPB_NAMESPACE, m)
// OPB_LIBRARY_IMPL(CPU, m) { m.impl("relu", &relu_cpu); }  (stable: TORCH_BOX(&relu_cpu))
#define OPB_LIBRARY_IMPL(k, m) OPB_LIBRARY_IMPL_EXPAND_(OPB_NAMESPACE, k, m)
