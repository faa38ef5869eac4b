// fused_relu_layernorm's forward kernels for bfloat16 data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_FORWARD(__nv_bfloat16)
