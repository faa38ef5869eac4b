from opbuilder.builders.base import BuiltinBuilder


class FusedReLULayerNormBuilder(BuiltinBuilder):
    NAME = "fused_relu_layernorm"

    def sources(self) -> list[str]:
        # One .cu per element type and direction, so nvcc compiles their kernels in parallel.
        return [
            "fused_relu_layernorm/binding.cpp",
            "fused_relu_layernorm/fused_relu_layernorm_cpu.cpp",
            "fused_relu_layernorm/fused_relu_layernorm.cu",
            *(f"fused_relu_layernorm/fused_relu_layernorm_{t}{d}.cu" for t in ("f32", "f16", "bf16", "f64")
              for d in ("", "_backward")),
        ]
