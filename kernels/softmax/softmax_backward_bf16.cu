// softmax's backward kernels for bfloat16 data.
#include "softmax_backward_typed.cuh"

OPB_SOFTMAX_BACKWARD(__nv_bfloat16)
