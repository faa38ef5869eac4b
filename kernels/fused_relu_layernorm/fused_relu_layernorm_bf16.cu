// fused_relu_layernorm's kernels for __nv_bfloat16 data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_INSTANTIATE(__nv_bfloat16)
