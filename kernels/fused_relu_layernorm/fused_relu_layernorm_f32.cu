// fused_relu_layernorm's kernels for float data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_INSTANTIATE(float)
