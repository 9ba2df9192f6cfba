"""Instructions of host work per eager cuda() ResNet9 step, counted by callgrind.

Wall and CPU times of a 2-ms step move by 30-50% between identical runs on a shared VM; the
instruction count of the same work moves by less than 0.1%, so changes to the eager path are
compared with this. It runs ``python bench/cuda_host_instructions.py --steps N`` under
``valgrind --tool=callgrind`` twice (N = 0 and N = --steps, each after 4 warm-up steps of
``bench_gpu._needle_resnet9_step`` on the no-op device of ``cuda_host_time.py``) and prints
the difference divided by N. The hash seed is fixed and BLAS keeps one thread: otherwise
start-up and an idle BLAS thread move the count by millions.

Usage:
    python bench/cuda_host_instructions.py [--steps 10] [--batch 128]
Needs valgrind on PATH. Counts never decide a test.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_steps(steps: int, batch: int) -> None:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "apps")]
    import cuda_host_time

    cuda_host_time.install_no_op_device()
    from bench_gpu import _needle_resnet9_step

    step = _needle_resnet9_step(batch, False)
    for _ in range(4 + steps):
        step()


def _count(steps: int, batch: int) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out",
             sys.executable, os.path.abspath(__file__), "--inner", "--steps", str(steps),
             "--batch", str(batch)],
            env=env, capture_output=True, text=True, check=True).stderr
    found = re.search(r"Collected : (\d+)", out)
    if found is None:
        raise RuntimeError(f"callgrind printed no instruction count:\n{out[-2000:]}")
    return int(found.group(1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        _run_steps(args.steps, args.batch)
        return 0
    if shutil.which("valgrind") is None:
        print("cuda_host_instructions: valgrind is not on PATH", file=sys.stderr)
        return 2
    if args.steps < 1:
        p.error(f"--steps: expected at least 1, got {args.steps}")
    base, more = _count(0, args.batch), _count(args.steps, args.batch)
    print(f"resnet9 b{args.batch} eager: {(more - base) / args.steps / 1e6:.2f} million "
          f"instructions of host work per step (callgrind, {args.steps} steps after 4 "
          f"warm-up steps, no-op kernels)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
