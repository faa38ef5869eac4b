"""The ops models use: functions and ``nn.Module`` layers. Importing builds nothing; a first call does."""

from opbuilder.ops.relu import ReLU, relu

__all__ = ["ReLU", "relu"]
