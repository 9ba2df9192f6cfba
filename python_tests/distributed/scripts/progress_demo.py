"""A training-loop shape with needle.distributed.progress, run by test_progress.py."""
from __future__ import annotations

import time

from needle.distributed.progress import progress_bar

bar = progress_bar(total=8, desc="steps", lines=4)
for step in range(8):
    time.sleep(0.15)
    bar.set_postfix(loss=f"{1.0 / (step + 1):.2f}")
    bar.update(1)
bar.write("epoch summary: loss 0.12")
bar.close()
