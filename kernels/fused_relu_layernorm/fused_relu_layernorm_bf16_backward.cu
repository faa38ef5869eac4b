// fused_relu_layernorm's backward kernels for bfloat16 data.
#include "fused_relu_layernorm_launch.cuh"

OPB_FRLN_BACKWARD(__nv_bfloat16)
