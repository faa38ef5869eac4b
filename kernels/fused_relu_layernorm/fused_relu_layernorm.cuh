// fused_relu_layernorm's CUDA launchers, as the binding sees them: raw pointers, sizes and a stream;
// no torch types.
#pragma once

#include <cuda_runtime_api.h>
#include <cstdint>

#include "fused_relu_layernorm_args.h"

namespace opb::fused_relu_layernorm {

cudaError_t launch_forward(const FwdArgs& args, cudaStream_t stream);

// Elements of workspace (float32, or float64 for Float64 data) the backward needs: the per-CTA
// partial sums of dw and db. 0 when dw is null. Depends on the current device.
int64_t backward_workspace_elems(const BwdArgs& args);

cudaError_t launch_backward(const BwdArgs& args, cudaStream_t stream);

}  // namespace opb::fused_relu_layernorm
