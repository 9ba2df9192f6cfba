"""``--verify-resume K``: certify that a killed-and-resumed run continues exactly.

Three runs of the same command (same strategy, ranks, seed, precision, ...):

1. *continuous*: ``--max-steps S`` straight through;
2. *killed*: ``--save-every K`` and ``--die-at-step K+1``: it writes its checkpoint at step K,
   then every rank SIGKILLs itself (a real kill: nothing is flushed on the way out); with
   ``--accumulate G > 1`` the kill lands in the middle of step K+1's accumulation, after its
   first micro-batch's backward (``--die-after-micro-batches 1``);
3. *resumed*: ``--resume`` from that checkpoint in a fresh process, on to step S.

The certificate compares the continuous run with killed + resumed: every parameter's bytes
(``params_sha256``), the whole training state with buffers and optimizer moments
(``state_sha256``), the loss of every step bit for bit, and the RNG ledgers draw by draw,
naming the first divergent draw when they differ. It is written to
``OUT/resume_certificate.json``; the exit status is 0 only when everything is identical.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

_DROP_WITH_VALUE = {"--verify-resume", "--out", "--resume", "--save-every", "--checkpoint-dir",
                    "--die-at-step", "--die-after-micro-batches", "--rng-ledger",
                    "--keep-checkpoints"}


def _base_argv(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _DROP_WITH_VALUE:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _run(script: str, argv: list[str], log: str) -> int:
    with open(log, "w") as f:
        return subprocess.run([sys.executable, script, *argv], stdout=f, stderr=subprocess.STDOUT,
                              timeout=3600).returncode


def _ledger(path: str, world_size: int) -> dict[int, list]:
    from needle.train_state.ledger import read_ledger

    from .loop import ledger_path

    ledgers = {}
    for rank in range(world_size):
        parts = [ledger_path(p, rank, world_size) for p in path.split("|")]
        ledgers[rank] = [e for p in parts if os.path.exists(p) for e in read_ledger(p)]
    return ledgers


def compare(continuous: dict, resumed: dict, ledgers_a: dict, ledgers_b: dict) -> dict:
    """The certificate: what matched and, for what did not, the first difference."""
    from needle.train_state.ledger import first_divergence

    losses_a, losses_b = continuous["losses"], resumed["losses"]
    pairs = enumerate(zip(losses_a, losses_b, strict=False))
    first_loss = next((i + 1 for i, (a, b) in pairs if a != b),
                      None if len(losses_a) == len(losses_b) else min(len(losses_a),
                                                                       len(losses_b)) + 1)
    rng = {rank: first_divergence(ledgers_a[rank], ledgers_b.get(rank, []))
           for rank in ledgers_a}
    cert = {
        "params_identical": continuous["params_sha256"] == resumed["params_sha256"],
        "state_identical": continuous.get("state_sha256") == resumed.get("state_sha256"),
        "losses_identical": first_loss is None,
        "first_different_step": first_loss,
        "rng_identical": all(v is None for v in rng.values()),
        "rng_first_divergence": {str(k): v for k, v in rng.items() if v is not None},
        "draws_compared": {str(k): len(v) for k, v in ledgers_a.items()},
        "steps": continuous["steps"],
    }
    cert["identical"] = all(cert[k] for k in ("params_identical", "state_identical",
                                              "losses_identical", "rng_identical"))
    return cert


def _remove_stale(*folders: str) -> None:
    """Outputs of an earlier certificate in the same folders (ledgers, checkpoints)."""
    import glob
    import shutil

    for folder in folders:
        for path in glob.glob(os.path.join(folder, "rng_ledger*.jsonl*")):
            os.unlink(path)
        shutil.rmtree(os.path.join(folder, "checkpoints"), ignore_errors=True)


def verify_resume(cfg, argv: list[str], script: str) -> int:
    """Run the three runs for ``cfg`` (parsed from ``argv``) and write the certificate."""
    out = os.path.abspath(cfg.out)
    os.makedirs(out, exist_ok=True)
    from .strategies import STRATEGIES

    base, k = _base_argv(argv), cfg.verify_resume
    world = STRATEGIES[cfg.strategy].ranks(cfg)  # every rank's ledger (ps: servers too)
    straight, killed = os.path.join(out, "continuous"), os.path.join(out, "resumed")
    ckpt = os.path.join(killed, "checkpoints")
    for d in (straight, killed):
        os.makedirs(d, exist_ok=True)
    ledger_a = os.path.join(straight, "rng_ledger.jsonl")
    _remove_stale(straight, killed)  # ledgers are appended to: a rerun must start clean
    mid_cycle = ["--die-after-micro-batches", "1"] if cfg.accumulate > 1 else []
    part1, part2 = (os.path.join(killed, f"rng_ledger_{n}.jsonl") for n in ("killed", "resumed"))
    codes = {
        "continuous": _run(script, [*base, "--out", straight, "--rng-ledger", ledger_a],
                           os.path.join(straight, "log.txt")),
        "killed": _run(script, [*base, "--out", killed, "--save-every", str(k),
                                "--checkpoint-dir", ckpt, "--die-at-step", str(k + 1),
                                *mid_cycle, "--rng-ledger", part1],
                       os.path.join(killed, "log_killed.txt")),
        "resumed": _run(script, [*base, "--out", killed, "--resume", ckpt,
                                 "--rng-ledger", part2], os.path.join(killed, "log_resumed.txt")),
    }
    if codes["continuous"] != 0 or codes["resumed"] != 0 or codes["killed"] == 0:
        print(f"train.py: --verify-resume: a run did not end as expected (exit codes "
              f"{codes}; the killed run must die); logs in {out}", file=sys.stderr)
        return 1
    with open(os.path.join(straight, "summary.json")) as f:
        a = json.load(f)
    with open(os.path.join(killed, "summary.json")) as f:
        b = json.load(f)
    cert = compare(a, b, _ledger(ledger_a, world), _ledger(f"{part1}|{part2}", world))
    cert.update(save_step=k, kill_step=k + 1, exit_codes=codes,
                kill_after_micro_batches=1 if mid_cycle else 0,
                micro_batches=cfg.accumulate, precision=cfg.precision)
    with open(os.path.join(out, "resume_certificate.json"), "w") as f:
        json.dump(cert, f, indent=2)
    verdict = "IDENTICAL" if cert["identical"] else "DIFFERENT"
    where = f"{k + 1}, after 1 of {cfg.accumulate} micro-batches" if mid_cycle else f"{k + 1}"
    print(f"resume certificate: {verdict} after {cert['steps']} steps (saved at {k}, killed "
          f"at {where}): parameters {cert['params_identical']}, training state "
          f"{cert['state_identical']}, losses {cert['losses_identical']}, random draws "
          f"{cert['rng_identical']} ({sum(cert['draws_compared'].values())} compared)")
    for rank, message in cert["rng_first_divergence"].items():
        print(f"  rank {rank}: {message}")
    if cert["first_different_step"] is not None:
        print(f"  first different loss at step {cert['first_different_step']}")
    print(f"wrote {os.path.join(out, 'resume_certificate.json')}")
    return 0 if cert["identical"] else 1
