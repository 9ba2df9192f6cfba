"""Joins the group the launcher chose and prints what happened as one JSON line: JOINED with
the group's backend, or REFUSED with NCCL's refusal (a machine without a GPU)."""
from __future__ import annotations

import json
import os

import needle.distributed as dist

env = {k: os.environ.get(k) for k in ("NEEDLE_DIST_BACKEND", "NEEDLE_DIST_NCCL_HOST")}
try:
    dist.init_process_group(timeout=60)
except dist.NcclUnavailable as exc:
    print("REFUSED", json.dumps({**env, "error": str(exc)}), flush=True)
else:
    print("JOINED", json.dumps({**env, "backend": dist.get_backend()}), flush=True)
    dist.destroy_process_group()
