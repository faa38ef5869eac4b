"""``opbuilder bench``: our ops beside PyTorch eager and torch.compile, on the same inputs in one run.

specs.py declares each op (inputs, reference, cost model, default shapes); timing.py times a step;
runner.py runs one case; report.py prints and writes the results; command.py is the command line.
"""

from opbuilder.tools.bench.command import main

__all__ = ["main"]
