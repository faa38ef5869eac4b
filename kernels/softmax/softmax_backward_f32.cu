// softmax's backward kernels for float data.
#include "softmax_backward_typed.cuh"

OPB_SOFTMAX_BACKWARD(float)
