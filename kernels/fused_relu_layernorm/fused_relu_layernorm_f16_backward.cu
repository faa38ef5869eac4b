// fused_relu_layernorm's backward kernels for float16 data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_BACKWARD(__half)
