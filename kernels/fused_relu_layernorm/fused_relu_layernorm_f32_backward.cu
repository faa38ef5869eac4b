// fused_relu_layernorm's backward kernels for float data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_BACKWARD(float)
