"""``python -m needle.memory``: see :mod:`needle.memory.cli` (subcommands profile, report, and
those registered by higher layers, such as ``checkpoint-report``)."""
from __future__ import annotations

import sys

from .cli import MOVED, main, parse, profile_script, register_command, report

__all__ = ["main", "parse", "report", "profile_script", "register_command", "MOVED"]

if __name__ == "__main__":
    sys.exit(main())
