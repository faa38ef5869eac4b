// fused_relu_layernorm's forward kernels for float data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_FORWARD(float)
