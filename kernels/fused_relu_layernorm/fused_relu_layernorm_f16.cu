// fused_relu_layernorm's forward kernels for float16 data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_FORWARD(__half)
