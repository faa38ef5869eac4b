// softmax's backward kernels for float64 data.
#include "softmax_backward_typed.cuh"

OPB_SOFTMAX_BACKWARD(double)
