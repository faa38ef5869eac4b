from opbuilder.builders.base import BuiltinBuilder


class SoftmaxBuilder(BuiltinBuilder):
    NAME = "softmax"

    def sources(self) -> list[str]:
        return [
            "softmax/binding.cpp",
            "softmax/softmax_cpu.cpp",
            "softmax/softmax.cu",
            "softmax/softmax_forward.cu",
            "softmax/softmax_backward.cu",
            *(f"softmax/softmax_{kind}_{t}.cu" for kind in ("forward", "backward") for t in ("f32", "f16", "bf16", "f64")),
        ]
