from opbuilder.builders.base import BuiltinBuilder


class AutogradGlueBuilder(BuiltinBuilder):
    """The C++ gradient path of the built-in ops (kernels/autograd/): classic torch headers, so one build
    a torch version (its key carries the exact torch); no CUDA code of its own (it calls the ops through
    the dispatcher)."""

    NAME = "autograd"
    ABI = "classic"

    def sources(self) -> list[str]:
        return ["autograd/glue.cpp"]
