"""The environment variables that mark a process as one rank of a distributed job.

needle's launchers set ``RANK`` (and ``NEEDLE_DIST_BACKEND``); MPICH's Hydra sets
``PMI_RANK``, Open MPI ``OMPI_COMM_WORLD_RANK``. Read by the progress bar (which rank draws)
and by the CPU backend (ranks share cores, so their OpenMP workers do not spin).

Example:
    >>> from needle._core.job_env import RANK_VARS
    >>> "PMI_RANK" in RANK_VARS
    True
"""
from __future__ import annotations

import os

RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


def is_rank() -> bool:
    """True when a launcher or mpiexec started this process as a rank of a job."""
    return any(os.environ.get(name) for name in (*RANK_VARS, "NEEDLE_DIST_BACKEND"))
