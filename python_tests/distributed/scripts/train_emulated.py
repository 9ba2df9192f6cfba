"""Run by test_nccl_models.py: ``apps/train.py`` with ``cuda()`` on the CUDA emulator and the
fake NCCL exchanging bytes between the rank processes. The launcher re-runs this same script
in every rank (``relaunch`` starts ``sys.argv[0]``), so each rank installs both first."""
from __future__ import annotations

import atexit
import os
import sys

import needle.autograd  # noqa: F401 - before needle.nn: works around a circular import

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..")
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(ROOT, "apps"))
import _fake_nccl  # noqa: E402

fake = _fake_nccl.install_in_this_process()


@atexit.register
def _calls() -> None:
    """The NCCL calls this process made, for the test to see that NCCL carried the job."""
    if os.environ.get("NEEDLE_LAUNCH_RANK") is not None:
        kinds = sorted({c["kind"] for c in fake.calls})
        print(f"NCCL CALLS {len(fake.calls)} {' '.join(kinds)}", flush=True)


import train  # noqa: E402 - apps/train.py

sys.exit(train.main(sys.argv[1:]))
