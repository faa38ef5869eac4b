// softmax's forward kernels for float16 data.
#include "softmax_forward_typed.cuh"

OPB_SOFTMAX_FORWARD(__half)
