// fused_relu_layernorm's kernels for __half data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_INSTANTIATE(__half)
