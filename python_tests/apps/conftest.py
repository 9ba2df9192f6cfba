"""Make ``apps/`` importable the way the course's suites do (``sys.path.append("./apps")``)."""
from __future__ import annotations

import os
import sys

APPS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "apps")
if APPS not in sys.path:
    sys.path.append(APPS)
