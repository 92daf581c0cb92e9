"""Launching `nanollama4` under torchrun (2 or 4 CPU processes, gloo, float32) for the distributed tests,
and comparing its runs with one process's: test_distributed.py (data parallel, checkpoints across world
sizes, failures) and test_expert_parallel.py (experts split over ranks) share these, in two files so that
make test's two workers take one each.

Each launch costs a few seconds (the processes import torch), so every comparison shares the runs it needs
(module-scoped fixtures), and a single process runs in the test's own (`main(argv)`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import write_corpus

TOL = 1e-5
BIN = Path(sys.executable).parent
COMMON = ["--quiet", "--no-plots", "--set", "batch_size=4", "--set", "seq_len=32", "--set", "eval_interval=3", "--set",
          "eval_batches=3", "--set", "warmup_steps=2", "--set", "threads=1"]
# the tutorial's routing: softmax top-2 over 4 experts, learned noise, capacity with overflow, bias balancing
MOE = ["--preset", "tiny", "--set", "experts_per_token=2", "--set", "capacity_factor=1.0", "--set",
       "bias_balance_rate=0.01", "--set", "router=softmax", "--set", "softmax.noise=learned"]


def launch(work, args: list[str], ranks: int = 1, script: list[str] | None = None, env: dict | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    """`nanollama4 ARGS` alone (in this process), or under `torchrun --nproc-per-node RANKS`."""
    if ranks == 1 and script is None and env is None:
        return in_process(work, args)
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(ranks), "--standalone",
           *(script or ["-m", "nanollama4"]), *args]
    return subprocess.run(cmd, cwd=work["root"], env={**work["env"], **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def in_process(work, args: list[str]) -> subprocess.CompletedProcess:
    """`nanollama4 ARGS` through `main(argv)` here, with the launches' token cache, as a finished process."""
    from nanollama4.cli import main

    out, err, before = io.StringIO(), io.StringIO(), os.environ.get("NANOLLAMA4_CACHE")
    os.environ["NANOLLAMA4_CACHE"] = work["env"]["NANOLLAMA4_CACHE"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        if before is None:
            os.environ.pop("NANOLLAMA4_CACHE", None)
        else:
            os.environ["NANOLLAMA4_CACHE"] = before
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def train(work, name: str, args: list[str], ranks: int = 1) -> Path:
    run = work["root"] / name
    out = launch(work, ["train", "--out", str(run), "--data", str(work["corpus"]), *COMMON, *args], ranks)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def resume(work, run: Path, steps: int, args: list[str], ranks: int) -> subprocess.CompletedProcess:
    out = launch(work, ["train", "--resume", str(run), "--max-steps", str(steps), "--quiet", "--no-plots", *args],
                 ranks)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def losses(run: Path) -> tuple[list[float], list[float]]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r], [r["val_loss"] for r in lines if "val_loss" in r]


def assert_same(run: Path, reference: Path, tol: float = TOL) -> None:
    (train_a, val_a), (train_b, val_b) = losses(run), losses(reference)
    assert len(train_a) == len(train_b) == 5 and len(val_a) == len(val_b) == 2
    assert max(abs(a - b) for a, b in zip(train_a + val_a, train_b + val_b, strict=True)) <= tol, \
        (train_a, val_a, train_b, val_b)


def new_work(root: Path) -> dict:
    """A corpus and a private token cache under `root`, shared by the module's launches."""
    corpus = write_corpus(root / "corpus.txt", n_lines=600)
    env = {**os.environ, "NANOLLAMA4_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    return {"root": root, "corpus": corpus, "env": env}
