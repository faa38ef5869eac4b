// fused_relu_layernorm's forward kernels for float64 data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_FORWARD(double)
