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
        ]
