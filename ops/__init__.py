"""The ops models use: functions and ``nn.Module`` layers. Importing builds nothing; a first call does."""

from opbuilder.ops.fused_add_rmsnorm import FusedAddRMSNorm, RMSNorm, fused_add_rmsnorm, rms_norm
from opbuilder.ops.fused_matmul_add_relu import FusedLinearReLU, fused_matmul_add_relu
from opbuilder.ops.fused_relu_layernorm import FusedReLULayerNorm, fused_relu_layernorm
from opbuilder.ops.relu import ReLU, relu
from opbuilder.ops.softmax import Softmax, softmax

__all__ = [
    "FusedAddRMSNorm",
    "FusedLinearReLU",
    "FusedReLULayerNorm",
    "RMSNorm",
    "ReLU",
    "Softmax",
    "fused_add_rmsnorm",
    "fused_matmul_add_relu",
    "fused_relu_layernorm",
    "relu",
    "rms_norm",
    "softmax",
]
