// softmax's backward kernels for float16 data.
#include "softmax_backward_typed.cuh"

OPB_SOFTMAX_BACKWARD(__half)
