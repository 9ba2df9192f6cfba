"""``--strategy single``: one process, no communication (the default for ``--nproc 1``)."""
from __future__ import annotations

from .base import Strategy


class SingleProcess(Strategy):
    """The plain training step of :class:`Strategy`, under its own name."""

    name = "single"
