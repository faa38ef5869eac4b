from opbuilder.builders.base import BuiltinBuilder


class FusedReLULayerNormBuilder(BuiltinBuilder):
    NAME = "fused_relu_layernorm"

    def sources(self) -> list[str]:
        # One .cu per element type, so nvcc compiles their kernels in parallel.
        return [
            "fused_relu_layernorm/binding.cpp",
            "fused_relu_layernorm/fused_relu_layernorm_cpu.cpp",
            "fused_relu_layernorm/fused_relu_layernorm.cu",
            "fused_relu_layernorm/fused_relu_layernorm_f32.cu",
            "fused_relu_layernorm/fused_relu_layernorm_f16.cu",
            "fused_relu_layernorm/fused_relu_layernorm_bf16.cu",
            "fused_relu_layernorm/fused_relu_layernorm_f64.cu",
        ]
