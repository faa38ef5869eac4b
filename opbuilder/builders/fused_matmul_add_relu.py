from opbuilder.builders.base import BuiltinBuilder


class FusedMatmulAddReluBuilder(BuiltinBuilder):
    NAME = "fused_matmul_add_relu"
    CUDA_LIBRARIES = ("cublasLt", "cublas")

    def sources(self) -> list[str]:
        return [
            "fused_matmul_add_relu/binding.cpp",
            "fused_matmul_add_relu/fused_matmul_add_relu_cpu.cpp",
            "fused_matmul_add_relu/fused_matmul_add_relu.cu",
            "fused_matmul_add_relu/relu_bias_backward.cu",
        ]
