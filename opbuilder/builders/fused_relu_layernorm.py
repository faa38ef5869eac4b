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

    def cxx_args(self) -> list[str]:
        # No multiply-add contraction on the CPU: the backward's second pass must form dy * w exactly as the
        # first pass summed it, or a row whose values are all alike (a 1-element row: dx is 0) gets that
        # product's rounding error times rstd (316 at eps 1e-5). Same speed here: these loops are memory-bound.
        return super().cxx_args() + ["-ffp-contract=off"]
