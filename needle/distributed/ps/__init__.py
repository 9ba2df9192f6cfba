"""needle.distributed.ps: a parameter server with sync, async, bounded-staleness (ssp) and
backup-worker modes, heartbeats, dead and restarted workers (docs/parameter_server.md)."""
from __future__ import annotations

from .layout import ParameterServerConfigError, Shard, plan_shards
from .parameter_server import MODES, ParameterServer

__all__ = ["MODES", "ParameterServer", "ParameterServerConfigError", "Shard", "plan_shards"]
