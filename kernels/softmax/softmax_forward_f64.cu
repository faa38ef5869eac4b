// softmax's forward kernels for float64 data.
#include "softmax_forward_typed.cuh"

OPB_SOFTMAX_FORWARD(double)
