"""``apps/train.py --backend``: the transport the ranks use (nccl: cuda() tensors by NCCL)."""
from __future__ import annotations

import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)
from training.config import UsageError, parse_args


def test_the_main_job_takes_the_backend_flag():
    assert parse_args(["--backend", "nccl", "--nproc", "2"], train.STRATEGIES).backend == "nccl"
    assert parse_args([], train.STRATEGIES).backend is None  # the launcher's choice


def test_an_unknown_backend_is_a_usage_error_naming_the_choices():
    with pytest.raises(UsageError, match="unknown --backend 'gloo', expected one of mpi, "
                                         "tcp, nccl"):
        parse_args(["--backend", "gloo"], train.STRATEGIES)
