"""Two hand-drawn progress bars on rank 0 (three frames each) and one line from rank 1: the
launcher's output tests count what arrives."""
from __future__ import annotations

import os
import sys
import time

if os.environ.get("RANK", "0") == "0":
    for bar in range(2):
        for step in range(1, 4):
            sys.stderr.write(f"\rbar {bar} step {step}/3")
            sys.stderr.flush()
            time.sleep(0.02)
        sys.stderr.write("\n")
    print("done", flush=True)
else:
    print("hello from rank 1", flush=True)
