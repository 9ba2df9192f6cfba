"""Training throughput: needle vs PyTorch CPU, same model, batch and optimiser, one run.

Workloads (the issue's): MLPResNet(784, 100, 3 blocks) batch 128 SGD; ResNet9 on 3×32×32
batch 128 SGD; 2-layer LSTM language model (vocab 10k, embedding 30, hidden 100, seq 20,
batch 16) SGD. Each side runs warm-up steps, then ``--repeats`` timed blocks of ``--steps``
steps, alternating needle and PyTorch; the median block gives items/second. PyTorch runs with
``--threads`` intra-op threads (2 = the machine); while needle runs, BLAS pools are limited to
the same count with threadpoolctl. torch is imported first, so both sides share its libgomp
at PyTorch's default settings (``bench/_openmp.py`` says why; the header prints them).

``--compiled`` adds a column: the same needle step under ``ndl.compile`` (traced once, then
replayed as a kernel program with its elementwise runs fused, every intermediate in one
planned arena), timed in the same alternation; the last column says how it replayed
(``kernels N/F``: N kernel calls per step, F of them fused runs; or ``python``).

Usage:
    python bench/bench_training.py [--quick] [--only mlp,resnet9,lstm] [--device cpu]
    python bench/bench_training.py --compiled
    python bench/bench_training.py --as-avx2   # both sides restricted to AVX2

``--as-avx2`` emulates an AVX2-only machine on an AVX-512 one (needle ``NEEDLE_CPU_ISA=avx2``,
PyTorch ``ATEN_CPU_CAPABILITY=avx2``, oneDNN ``ONEDNN_MAX_CPU_ISA=AVX2``, OpenBLAS
``OPENBLAS_CORETYPE=Haswell``). The header names the kernels each side runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--as-avx2" in sys.argv:  # before needle's module, torch and OpenBLAS load
    os.environ.update(NEEDLE_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2",
                      ONEDNN_MAX_CPU_ISA="AVX2", OPENBLAS_CORETYPE="Haswell")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import _openmp  # noqa: E402
import numpy as np  # noqa: E402

_openmp.load_torch_first()  # before needle loads the C++ kernels: see the module docstring


# ---- needle side ----------------------------------------------------------------------------
def needle_step_fn(workload: str, device, compiled: bool = False):
    """A zero-argument function doing one training step, and items per step; ``compiled``:
    the step runs under ``ndl.compile`` (the loss is read after the compiled call)."""
    from models import LanguageModel, ResNet9

    from needle import nn, optim
    from needle.autograd import Tensor

    np.random.seed(0)
    if workload == "mlp":
        model = _mlp_on(device)
        x = Tensor(np.random.rand(128, 784).astype(np.float32), device=device,
                   requires_grad=False)
        y = Tensor(np.random.randint(0, 10, 128), device=device, requires_grad=False)
        items, h0 = 128, None
    elif workload == "resnet9":
        model = ResNet9(device=device)
        # data does not require grad (as in PyTorch): no gradient for the input images
        x = Tensor(np.random.rand(128, 3, 32, 32).astype(np.float32), device=device,
                   requires_grad=False)
        y = Tensor(np.random.randint(0, 10, 128), device=device, requires_grad=False)
        items, h0 = 128, None
    else:
        model = LanguageModel(30, 10000, 100, num_layers=2, seq_model="lstm", device=device)
        x = Tensor(np.random.randint(0, 10000, (20, 16)), device=device, requires_grad=False)
        y = Tensor(np.random.randint(0, 10000, 320), device=device, requires_grad=False)
        items, h0 = 320, True
    loss_fn = nn.SoftmaxLoss()
    opt = optim.SGD(model.parameters(), lr=0.01)
    model.train()

    def train_step(x, y):
        out = model(x)[0] if h0 else model(x)
        loss = loss_fn(out, y)
        opt.reset_grad()
        loss.backward()
        opt.step()
        return loss

    if compiled:
        from needle import compile as ndl_compile

        train_step = ndl_compile(train_step)

    def step():
        return train_step(x, y).numpy()

    step.compiled = train_step if compiled else None
    return step, items


def _mlp_on(device):
    # apps/train.py builds exactly the course's MLPResNet, but on a chosen device.
    from train import build_model

    return build_model("mlp_resnet", 784, 10, 100, device)


# ---- PyTorch side ---------------------------------------------------------------------------
def torch_step_fn(workload: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if workload == "mlp":
        def block(dim, hidden):
            return nn.Sequential(_TorchResidual(nn.Sequential(
                nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.1),
                nn.Linear(hidden, dim), nn.BatchNorm1d(dim))), nn.ReLU())
        model = nn.Sequential(nn.Linear(784, 100), nn.ReLU(),
                              *[block(100, 50) for _ in range(3)], nn.Linear(100, 10))
        x, y, items = torch.rand(128, 784), torch.randint(0, 10, (128,)), 128
    elif workload == "resnet9":
        model = _torch_resnet9()
        x, y, items = torch.rand(128, 3, 32, 32), torch.randint(0, 10, (128,)), 128
    else:
        model = _TorchLM()
        x, y, items = torch.randint(0, 10000, (20, 16)), torch.randint(0, 10000, (320,)), 320
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()

    def step():
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step, items


def _torch_modules():
    from torch import nn
    return nn


class _TorchResidual:  # replaced by a real nn.Module subclass at first use (lazy torch import)
    def __new__(cls, fn):
        nn = _torch_modules()

        class Residual(nn.Module):
            def __init__(self, f):
                super().__init__()
                self.fn = f

            def forward(self, x):
                return self.fn(x) + x

        return Residual(fn)


def _torch_resnet9():
    nn = _torch_modules()

    def cbr(a, b, k, s):
        return nn.Sequential(nn.Conv2d(a, b, k, s, k // 2), nn.BatchNorm2d(b), nn.ReLU())

    return nn.Sequential(
        cbr(3, 16, 7, 4), cbr(16, 32, 3, 2),
        _TorchResidual(nn.Sequential(cbr(32, 32, 3, 1), cbr(32, 32, 3, 1))),
        cbr(32, 64, 3, 2), cbr(64, 128, 3, 2),
        _TorchResidual(nn.Sequential(cbr(128, 128, 3, 1), cbr(128, 128, 3, 1))),
        nn.Flatten(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


class _TorchLM:
    def __new__(cls):
        nn = _torch_modules()

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embedding = nn.Embedding(10000, 30)
                self.lstm = nn.LSTM(30, 100, 2)
                self.linear = nn.Linear(100, 10000)

            def forward(self, x):
                out, _ = self.lstm(self.embedding(x))
                return self.linear(out.reshape(-1, 100))

        return LM()


# ---- timing ---------------------------------------------------------------------------------
def _time_block(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - start


def measure(workload: str, steps: int, repeats: int, threads: int, device,
            compiled: bool = False) -> dict:
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    n_step, items = needle_step_fn(workload, device)
    c_step = needle_step_fn(workload, device, compiled=True)[0] if compiled else None
    t_step, _ = torch_step_fn(workload)
    with threadpool_limits(limits=threads):
        for _ in range(5):  # a compiled step warms up, traces, records twice, then replays
            n_step()
            if c_step is not None:
                c_step()
    for _ in range(2):
        t_step()
    n_times, c_times, t_times = [], [], []
    for _ in range(repeats):  # alternate: VM noise hits every side alike
        with threadpool_limits(limits=threads):
            n_times.append(_time_block(n_step, steps))
            if c_step is not None:
                c_times.append(_time_block(c_step, steps))
        t_times.append(_time_block(t_step, steps))
    n_rate = items * steps / statistics.median(n_times)
    t_rate = items * steps / statistics.median(t_times)
    out = {"workload": workload, "needle": n_rate, "torch": t_rate, "ratio": n_rate / t_rate}
    if c_step is not None:
        c_rate = items * steps / statistics.median(c_times)
        mode = c_step.compiled.replay_mode()
        how = (f"kernels {mode['kernels']}/{mode['fused_runs']}" if mode["mode"] == "kernels"
               else mode["mode"])
        out.update(compiled=c_rate, compiled_ratio=c_rate / t_rate, replay=how)
    return out


UNITS = {"mlp": "examples/s", "resnet9": "images/s", "lstm": "tokens/s"}
TITLES = {"mlp": "MLPResNet(784,100,3) b128 SGD", "resnet9": "ResNet9 3x32x32 b128 SGD",
          "lstm": "LSTM LM 2x100, vocab 10k, seq 20, b16 SGD"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="mlp,resnet9,lstm")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default=None, help="needle device (default: cpu if built)")
    p.add_argument("--quick", action="store_true", help="3 steps × 3 repeats")
    p.add_argument("--as-avx2", action="store_true", help="both sides restricted to AVX2")
    p.add_argument("--compiled", action="store_true",
                   help="add the needle step under ndl.compile as a column")
    args = p.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(TITLES))
    if unknown:
        p.error(f"--only: unknown workload(s) {unknown}, expected some of {sorted(TITLES)}")
    import needle.backend_ndarray as nd

    device = nd.default_device() if args.device is None else nd.device_by_name(args.device)
    steps, repeats = (3, 3) if args.quick else (args.steps, args.repeats)
    torch = __import__("torch")
    kernels = ""
    if device.name == "cpu":
        info = device.mod._kernel_info()
        kernels = f" (kernels {info['isa']}, sgemm {info['sgemm']})"
    print(f"needle on {device}{kernels}, PyTorch {torch.__version__} (CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}) with {args.threads} threads; "
          f"{repeats} x {steps} steps, medians; load average {os.getloadavg()[0]:.2f}; "
          f"{_openmp.describe()}", flush=True)
    extra = f" {'compiled':>12s} {'comp/pt':>7s}" if args.compiled else ""
    print(f"{'workload':44s} {'needle':>12s} {'pytorch':>12s} {'ratio':>7s}{extra}")
    for workload in args.only.split(","):
        r = measure(workload, steps, repeats, args.threads, device, args.compiled)
        extra = (f" {r['compiled']:12,.0f} {r['compiled_ratio']:7.2f}  {r['replay']}"
                 if args.compiled else "")
        print(f"{TITLES[workload]:44s} {r['needle']:12,.0f} {r['torch']:12,.0f} "
              f"{r['ratio']:7.2f}{extra}  ({UNITS[workload]})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
