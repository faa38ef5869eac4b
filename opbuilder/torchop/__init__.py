"""Torch-facing glue of the ops: registration on first call, the eager fast path, sharding rules."""
