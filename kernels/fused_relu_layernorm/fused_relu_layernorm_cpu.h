// fused_relu_layernorm's CPU kernels, as the binding sees them.
#pragma once

#include "fused_relu_layernorm_args.h"

namespace opb::fused_relu_layernorm {

// rows >= 1, hidden >= 1; every buffer contiguous.
void forward_cpu(const FwdArgs& args);

// rows >= 1, hidden >= 1; args.workspace is not used.
void backward_cpu(const BwdArgs& args);

}  // namespace opb::fused_relu_layernorm
