"""The remote cache tier: one build per cluster (``OPB_REMOTE_CACHE``).

``backend``: the ``RemoteCache`` interface a store follows; ``redis_backend``: the Redis store;
``tier``: download, check, publish locally, build under a cluster-wide lease, share. The build
sequence (``opbuilder.jit.build.ensure_built``) asks ``tier()`` for the configured tier.
"""

from opbuilder.jit.remote.backend import Entry, RemoteCache, RemoteUnavailable, State
from opbuilder.jit.remote.tier import STATS, Tier, describe, sign, tier

__all__ = ["Entry", "RemoteCache", "RemoteUnavailable", "STATS", "State", "Tier", "describe", "sign", "tier"]
