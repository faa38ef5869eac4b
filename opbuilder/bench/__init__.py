"""Only ``python -m opbuilder.bench``: the benchmark itself is ``opbuilder.tools.bench``."""
