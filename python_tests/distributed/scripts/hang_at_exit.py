"""Run by test_launcher_lifecycle.py: ``hang_at_exit.py RANK``. Every rank finishes its work
and reports success; rank RANK then blocks for ever in interpreter shutdown (an atexit handler),
as a library stuck in its own shutdown would."""
from __future__ import annotations

import atexit
import os
import sys
import threading

rank = int(os.environ["RANK"])
print(f"WORK DONE rank {rank}", flush=True)
if rank == int(sys.argv[1]):
    atexit.register(threading.Event().wait)
