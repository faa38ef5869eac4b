from opbuilder.builders.base import BuiltinBuilder


class ReluBuilder(BuiltinBuilder):
    NAME = "relu"

    def sources(self) -> list[str]:
        return ["relu/binding.cpp", "relu/relu_cpu.cpp", "relu/relu.cu"]
