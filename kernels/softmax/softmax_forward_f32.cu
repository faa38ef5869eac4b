// softmax's forward kernels for float data.
#include "softmax_forward_typed.cuh"

OPB_SOFTMAX_FORWARD(float)
