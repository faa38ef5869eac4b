// softmax's forward kernels for bfloat16 data.
#include "softmax_forward_typed.cuh"

OPB_SOFTMAX_FORWARD(__nv_bfloat16)
