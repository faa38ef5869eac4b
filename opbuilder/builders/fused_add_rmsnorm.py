from opbuilder.builders.base import BuiltinBuilder


class FusedAddRMSNormBuilder(BuiltinBuilder):
    NAME = "fused_add_rmsnorm"

    def sources(self) -> list[str]:
        # Forward and backward kernels are separate translation units so that they compile in parallel.
        return [
            "fused_add_rmsnorm/binding.cpp",
            "fused_add_rmsnorm/fused_add_rmsnorm_cpu.cpp",
            "fused_add_rmsnorm/fused_add_rmsnorm.cu",
            "fused_add_rmsnorm/fused_add_rmsnorm_backward.cu",
        ]
