"""``apps/train.py --help`` reads as a manual: every option says what it does, a default is
shown once and only where it says something, the accepted values are listed; a 3d mesh that
does not match --nproc says what to set."""
from __future__ import annotations

import re

import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)
from training.config import build_parser
from training.strategies import STRATEGIES


@pytest.fixture(scope="module")
def text() -> str:
    return build_parser(STRATEGIES).format_help()


def test_no_default_is_shown_twice_or_empty(text):
    flat = " ".join(text.split())  # help lines wrap
    for bad in ("(default: None)", "(default: True)", "(default: False)"):
        assert bad not in flat
    assert not re.search(r"\(default: [^)]*\) \(default:", flat)


def test_every_option_has_help():
    for action in build_parser(STRATEGIES)._actions:
        assert action.help, action.option_strings


def test_the_accepted_values_are_listed(text):
    flat = " ".join(text.split())
    for choices in ("--data {digits,mnist}", "--optimizer {adam,sgd}",
                    "--precision {fp32,fp16-mixed,bf16-mixed}", "--backend {mpi,tcp,nccl}",
                    "--epochs EPOCHS passes over the "
                    "training data (default: "):
        assert choices in flat


def test_a_mesh_that_does_not_match_nproc_says_what_to_set():
    with pytest.raises(train.UsageError, match="with --nproc 2 set one of --dp 2, --tp 2, "
                                               "--pp 2"):
        train.parse_args(["--strategy", "3d", "--nproc", "2"])
