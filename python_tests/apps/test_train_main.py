"""The main job apps/train.py: accuracy on the digits, end-to-end outputs, bad arguments."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import train  # noqa: E402 - apps/ is on sys.path (conftest)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "apps", "train.py")
MNIST_DIR = os.path.join(REPO, "..", "shared", "data", "mnist")


def _run(*args, timeout=120):
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_digits_training_reaches_95_percent():
    cfg = train.parse_args(["--epochs", "8", "--no-progress", "--seed", "0"])
    summary = train.train(cfg)
    assert summary["accuracy"] >= 0.95 and summary["final_test_accuracy"] == summary["accuracy"]
    assert summary["train_examples"] + summary["test_examples"] == 1797
    assert summary["test_examples"] == round(1797 * 0.2)
    h = summary["history"]
    assert h["train_loss"][-1] < h["train_loss"][0]


def test_digits_holdout_is_disjoint_and_seeded():
    a = train.load_digits_split(seed=3)
    b = train.load_digits_split(seed=3)
    for x, y in zip(a, b, strict=False):
        np.testing.assert_array_equal(x, y)
    X, _, Xt, _ = a
    rows = {r.tobytes() for r in X}
    # sklearn's digits contain a few duplicate images; nearly all held-out rows are unseen.
    assert sum(r.tobytes() in rows for r in Xt) < 10
    assert X.max() <= 1.0 and X.dtype == np.float32


def _check_outputs(out_dir, epochs):
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    assert 0.0 <= summary["final_test_accuracy"] <= 1.0
    assert summary["examples_per_second"] > 0 and np.isfinite(summary["final_train_loss"])
    assert len(summary["history"]["test_acc"]) == epochs
    with open(os.path.join(out_dir, "training.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(os.path.join(out_dir, "training.png")) > 5000
    return summary


def test_main_job_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = _run("--epochs", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out accuracy" in proc.stdout and "examples/second" in proc.stdout
    assert proc.stdout.count("epoch ") == 2  # per-epoch lines are printed with progress on
    summary = _check_outputs(out, 2)
    assert summary["final_test_accuracy"] > 0.8
    assert summary["config"]["model"] == "mlp_resnet"


@pytest.mark.skipif(not os.path.exists(os.path.join(MNIST_DIR, "t10k-labels-idx1-ubyte.gz")),
                    reason="MNIST t10k files absent")
def test_main_job_on_mnist_t10k(tmp_path):
    proc = _run("--data", "mnist", "--data-dir", MNIST_DIR, "--model", "mlp", "--epochs", "1",
                "--batch-size", "128", "--out", str(tmp_path), "--no-progress",
                "--device", "cpu_numpy")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = _check_outputs(tmp_path, 1)
    assert summary["test_examples"] == 2000 and summary["final_test_accuracy"] > 0.8


@pytest.mark.parametrize("args,needle", [
    (["--model", "transformerxl"], "unknown --model"),
    (["--data", "mnist", "--data-dir", "/nonexistent/dir"], "data directory not found"),
    (["--data", "mnist"], "--data-dir"),
    (["--device", "tpu"], "unknown --device"),
    (["--epochs", "0"], "--epochs must be positive"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_arguments_give_one_line(args, needle):
    proc = _run(*args, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


def test_mnist_dir_without_files(tmp_path):
    with pytest.raises(train.UsageError, match="no MNIST files"):
        train.load_mnist_split(str(tmp_path))


def test_small_cnn_trains_a_step():
    import needle.backend_ndarray as nd
    from needle import nn, optim
    from needle.autograd import Tensor

    np.random.seed(0)
    model = train.build_model("cnn", 64, 10, 32, nd.cpu_numpy())
    x = Tensor(np.random.rand(4, 64), device=nd.cpu_numpy())
    y = Tensor(np.array([1, 2, 3, 4]), device=nd.cpu_numpy())
    loss = nn.SoftmaxLoss()(model(x), y)
    opt = optim.SGD(model.parameters(), lr=0.1)
    loss.backward()
    opt.step()
    assert model(x).shape == (4, 10)


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["mpi", "tcp"])
def test_main_job_data_parallel_two_ranks(tmp_path, backend):
    """--nproc 2 trains through the launcher and reaches single-process accuracy."""
    env_backup = os.environ.get("NEEDLE_DIST_BACKEND")
    os.environ["NEEDLE_DIST_BACKEND"] = backend
    try:
        result = _run("--nproc", "2", "--epochs", "8", "--no-progress", "--out",
                      str(tmp_path), timeout=200)
    finally:
        if env_backup is None:
            os.environ.pop("NEEDLE_DIST_BACKEND")
        else:
            os.environ["NEEDLE_DIST_BACKEND"] = env_backup
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "[rank 0] held-out accuracy" in result.stdout and "x 2 ranks" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["final_test_accuracy"] >= 0.95
    assert (tmp_path / "training.png").stat().st_size > 1000
    assert summary["strategy"] == "ddp" and summary["steps"] == 8 * summary["steps_per_epoch"]


# ---- the step loop, the summary contract and the strategy registry -------------------------
CONTRACT_KEYS = ("accuracy", "final_loss", "strategy", "world_size", "steps", "wall_s",
                 "examples_per_s", "params_sha256", "losses")


def _quiet(*args):
    return train.parse_args([*args, "--no-progress"])


def test_summary_contract_and_max_steps():
    summary = train.train(_quiet("--model", "mlp", "--max-steps", "7", "--epochs", "5"))
    for key in CONTRACT_KEYS:
        assert key in summary, key
    assert summary["steps"] == 7 and len(summary["losses"]) == 7
    assert summary["strategy"] == "single" and summary["world_size"] == 1
    assert summary["final_loss"] == summary["losses"][-1]
    assert len(summary["history"]["epoch"]) == 1  # stopped inside the first epoch, evaluated
    assert 0.0 <= summary["accuracy"] <= 1.0 and len(summary["params_sha256"]) == 64


def test_seed_makes_runs_repeatable_and_distinct():
    a = train.train(_quiet("--model", "mlp", "--max-steps", "5", "--seed", "1"))
    b = train.train(_quiet("--model", "mlp", "--max-steps", "5", "--seed", "1"))
    c = train.train(_quiet("--model", "mlp", "--max-steps", "5", "--seed", "2"))
    assert a["params_sha256"] == b["params_sha256"] and a["losses"] == b["losses"]
    assert a["params_sha256"] != c["params_sha256"]


def test_compiled_steps_train_the_same_parameters_bit_for_bit():
    """--compile: after warm-up, trace and two recorded calls, the steps replay as a kernel
    program; the run's parameters and losses are those of the eager run exactly."""
    args = ("--max-steps", "12", "--epochs", "3", "--batch-size", "128")
    eager = train.train(_quiet(*args))
    compiled = train.train(_quiet(*args, "--compile"))
    assert compiled["params_sha256"] == eager["params_sha256"]
    assert compiled["losses"] == eager["losses"]
    block = compiled["compile"]
    assert block["mode"] == "kernels" and block["kernel_replays"] >= 6
    assert block["fused_runs"] > 0 and "compile" not in eager


def test_compile_refuses_what_it_does_not_run():
    with pytest.raises(train.UsageError, match="--compile runs fp32 steps"):
        train.parse_args(["--compile", "--accumulate", "2"])


@pytest.mark.parametrize("args", [["--nproc", "2"], ["--nproc", "2", "--strategy", "zero"],
                                  ["--strategy", "tp", "--nproc", "2"]])
def test_compile_refuses_strategies_of_several_ranks(args):
    """Only the single strategy traces its step: elsewhere --compile was silently eager."""
    with pytest.raises(train.UsageError, match=r"--compile runs the single-process step; "
                                               r"with --nproc 2 --strategy \w+ .*not supported "
                                               r"yet: use --compile with --nproc 1"):
        train.parse_args(["--compile", *args])


def test_outside_launcher_is_refused_in_one_line(tmp_path):
    """``mpiexec -n 2 python apps/train.py``: each process would train alone into one
    folder. The first says why in one line and writes nothing; the others exit quietly."""
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1", PMI_SIZE="2", PMI_RANK="0")
    env.pop("NEEDLE_LAUNCH_STATUS_DIR", None)
    out = tmp_path / "run"
    args = [sys.executable, SCRIPT, "--max-steps", "1", "--no-progress", "--out", str(out)]
    first = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert first.returncode == 2, first.stdout + first.stderr
    assert first.stderr.strip().splitlines() == [
        "train.py: error: started by an outside launcher as one of 2 processes: use "
        "`python apps/train.py --nproc 2` (needle starts the ranks itself)"]
    second = subprocess.run(args, capture_output=True, text=True, timeout=120,
                            env={**env, "PMI_RANK": "1"}, cwd=REPO)
    assert (second.returncode, second.stderr) == (2, "") and not out.exists()


def test_params_sha256_covers_every_byte():
    p = [np.zeros((2, 3), np.float32), np.ones(4, np.float32)]
    q = [x.copy() for x in p]
    q[1][3] = np.nextafter(np.float32(1), np.float32(2))
    assert train.params_sha256(p) != train.params_sha256(q)
    # the shape is part of the hash: the same bytes in another layout differ
    assert train.params_sha256([p[0].reshape(3, 2), p[1]]) != train.params_sha256(p)


def test_each_optimizer_has_its_own_learning_rate():
    # SGD used to inherit Adam's 0.003 and ended below chance after 2 epochs.
    cfg = _quiet("--optimizer", "sgd", "--epochs", "2")
    assert cfg.learning_rate == 0.1
    summary = train.train(cfg)
    assert summary["accuracy"] > 0.85
    assert _quiet("--optimizer", "adam").learning_rate == 0.003
    assert _quiet("--optimizer", "sgd", "--lr", "0.5").learning_rate == 0.5


def test_help_shows_every_default():
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for fragment in ("adam 0.003", "sgd 0.1", "(default: 64)", "(default: digits)",
                     "--strategy", "--slow-worker", "--kill-worker", "--die-at-step"):
        assert fragment in text, fragment


@pytest.mark.parametrize("args,needle", [
    (["--strategy", "carrier-pigeon"], "unknown --strategy"),
    (["--strategy", "single", "--nproc", "2"], "runs one process"),
    (["--strategy", "ddp"], "needs --nproc >= 2"),
    (["--max-steps", "0"], "--max-steps must be positive"),
    (["--slow-worker", "1"], "RANK:MS"),
    (["--kill-worker", "x@3"], "RANK must be an integer"),
    (["--kill-worker", "5@3"], "RANK must be in [0, 1)"),
])
def test_strategy_and_fault_arguments_are_checked(args, needle):
    with pytest.raises(train.UsageError, match=re.escape(needle)):
        cfg = train.parse_args(args)
        train.train(cfg)


def test_die_at_step_really_sigkills(tmp_path):
    proc = _run("--model", "mlp", "--die-at-step", "3", "--out", str(tmp_path), "--no-progress")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "--die-at-step 3" in proc.stderr
    assert not (tmp_path / "summary.json").exists()


def test_slow_worker_really_sleeps():
    summary = train.train(_quiet("--model", "mlp", "--max-steps", "4", "--slow-worker", "0:150"))
    assert summary["wall_s"] >= 4 * 0.150  # a lower bound: load only makes it later


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_ddp_step_equals_the_single_process_step(tmp_path):
    """Without BatchNorm or dropout, 2 DDP ranks compute the very same steps as 1 process."""
    # an odd global batch: the ranks hold 32 and 31 examples, so their weights matter
    single = train.train(_quiet("--model", "mlp", "--max-steps", "12", "--seed", "4",
                                "--batch-size", "63"))
    proc = _run("--model", "mlp", "--max-steps", "12", "--seed", "4", "--nproc", "2",
                "--batch-size", "63",
                "--no-progress", "--out", str(tmp_path), timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ddp = json.loads((tmp_path / "summary.json").read_text())
    assert ddp["steps"] == 12 and ddp["world_size"] == 2
    np.testing.assert_allclose(ddp["losses"], single["losses"], rtol=2e-4, atol=2e-5)
    # the traffic ledger: per step, the gradient all-reduce predicted (ring: 2(n-1)/n x M per
    # bucket, so M for two ranks) equals what the transport was handed
    traffic = ddp["traffic"]
    assert traffic["all_match"] and traffic["sent"] == traffic["predicted_sent"] > 0
    steps = [s for s in traffic["steps"] if s["step"] >= 1]
    assert len(steps) == 12
    for step in steps:
        grads = step["by_label"]["ddp gradients"]
        assert grads["sent"] == grads["expected_sent"] == grads["predicted_sent"]
        assert grads["sent"] == 4 * ddp["parameters"]  # n = 2: each rank sends M
    assert "traffic (rank 0)" in proc.stdout and "all equal" in proc.stdout


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_kill_worker_sigkills_that_rank(tmp_path):
    proc = _run("--model", "mlp", "--nproc", "2", "--kill-worker", "1@3", "--no-progress",
                "--out", str(tmp_path), timeout=200)
    assert proc.returncode != 0
    assert "--kill-worker 1@3" in proc.stdout + proc.stderr
    assert not (tmp_path / "summary.json").exists()


# ---- checkpoints and the exact-resume certificate ---------------------------------------------
def _certificate(tmp_path, *args, timeout=300):
    proc = _run("--max-steps", "30", "--verify-resume", "12", "--no-progress",
                "--out", str(tmp_path), *args, timeout=timeout)
    cert_path = tmp_path / "resume_certificate.json"
    assert cert_path.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, json.loads(cert_path.read_text())


@pytest.mark.slow
def test_killed_and_resumed_run_is_identical_with_dropout_and_batchnorm(tmp_path):
    proc, cert = _certificate(tmp_path)  # mlp_resnet: Dropout(0.1) and BatchNorm1d
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cert["identical"] and cert["exit_codes"]["killed"] == -signal.SIGKILL
    assert cert["draws_compared"]["0"] >= 30 * 3  # three dropout layers draw every step
    assert "IDENTICAL" in proc.stdout


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_and_resumed_ddp_run_is_identical(tmp_path):
    proc, cert = _certificate(tmp_path, "--nproc", "2", timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cert["identical"] and set(cert["draws_compared"]) == {"0", "1"}


def test_certificate_names_what_differs():
    from training.verify_resume import compare

    run = {"params_sha256": "a", "state_sha256": "s", "losses": [1.0, 2.0, 3.0], "steps": 3}
    entry = {"stream": "host", "offset": 0, "count": 2, "kind": "rand", "shape": [2],
             "digest": "x", "site": "f.py:1 Dropout.forward", "rank": 0}
    same = compare(run, dict(run), {0: [entry]}, {0: [dict(entry)]})
    assert same["identical"] and same["first_different_step"] is None
    other = dict(run, losses=[1.0, 2.5, 3.0], state_sha256="t")
    diff = compare(run, other, {0: [entry]}, {0: [dict(entry, digest="y")]})
    assert not diff["identical"] and diff["first_different_step"] == 2
    assert not diff["state_identical"] and diff["params_identical"]
    assert "Dropout.forward" in diff["rng_first_divergence"]["0"]


def test_resume_continues_and_keeps_the_newest_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = _quiet("--model", "mlp", "--max-steps", "20", "--save-every", "5",
                 "--checkpoint-dir", str(ckpt), "--keep-checkpoints", "2")
    straight = train.train(cfg)
    assert sorted(os.listdir(ckpt)) == ["run.json", "step-00000015", "step-00000020"]
    # resume from step 20 and go on to 26: the first 20 losses are the saved ones
    resumed = train.train(_quiet("--model", "mlp", "--max-steps", "26", "--resume", str(ckpt)))
    assert resumed["steps"] == 26 and resumed["losses"][:20] == straight["losses"]
    longer = train.train(_quiet("--model", "mlp", "--max-steps", "26"))
    assert resumed["params_sha256"] == longer["params_sha256"]


def test_resume_refuses_other_options(tmp_path):
    ckpt = tmp_path / "ckpt"
    train.train(_quiet("--model", "mlp", "--max-steps", "4", "--save-every", "2",
                       "--checkpoint-dir", str(ckpt)))
    with pytest.raises(train.UsageError, match="--seed 0 -> 5.*|--seed"):
        train.train(_quiet("--model", "mlp", "--max-steps", "6", "--seed", "5",
                           "--resume", str(ckpt)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(train.UsageError, match="no complete checkpoint"):
        train.train(_quiet("--model", "mlp", "--resume", str(empty)))
    with pytest.raises(train.UsageError, match="0 < K < S"):
        train.parse_args(["--verify-resume", "5"])
