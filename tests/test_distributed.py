"""torchrun training on 2 CPU processes (gloo, float32), through the CLI, against one process.

A step of R ranks x batch b x accumulation a must be the step one process takes with batch b and
accumulation R x a: same windows, same micro-batches, same losses. Checkpoints must move between world
sizes. Each launch costs a few seconds (two Python processes importing torch), so every comparison
shares the runs it needs (module-scoped fixtures), and a single process runs in this one (`main(argv)`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import write_corpus

TOL = 1e-5
BIN = Path(sys.executable).parent
COMMON = ["--quiet", "--no-plots", "--set", "batch_size=4", "--set", "seq_len=32", "--set", "eval_interval=3", "--set",
          "eval_batches=3", "--set", "warmup_steps=2", "--set", "threads=1"]
# the tutorial's routing: softmax top-2 over 4 experts, learned noise, capacity with overflow, bias balancing
MOE = ["--preset", "tiny", "--set", "experts_per_token=2", "--set", "capacity_factor=1.0", "--set",
       "bias_balance_rate=0.01", "--set", "router=softmax", "--set", "softmax.noise=learned"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    corpus = write_corpus(root / "corpus.txt", n_lines=600)
    env = {**os.environ, "NANOLLAMA4_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    return {"root": root, "corpus": corpus, "env": env}


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


@pytest.fixture(scope="module")
def dense_reference(work):
    """The tiny preset, 5 steps of one process with batch 4 and 2 accumulation steps."""
    return train(work, "one-process", ["--preset", "tiny", "--max-steps", "5", "--set", "grad_accum=2"])


@pytest.fixture(scope="module")
def moe_reference(work):
    return train(work, "one-process-moe", [*MOE, "--max-steps", "5", "--set", "grad_accum=2"])


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_data_parallel_matches_one_process_with_accumulation(work, dense_reference, kind):
    run = train(work, f"two-{kind}", ["--preset", "tiny", "--max-steps", "5", "--set", f"parallel={kind}"], ranks=2)
    assert_same(run, dense_reference)
    saved = json.loads((run / "last" / "train_state.json").read_text())
    assert saved["world_size"] == 2


def test_expert_parallel_matches_one_process(work, moe_reference):
    run = train(work, "two-ep", [*MOE, "--max-steps", "5", "--set", "expert_parallel=2"], ranks=2)
    assert_same(run, moe_reference)
    load = [json.loads(line)["expert_load"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "expert_load" in line]
    assert len(load) == 5 and all(abs(sum(layer) - 1) < 1e-3 for step in load for layer in step)


def test_muon_with_ddp_and_expert_parallel_matches_one_process(work):
    """Muon under torchrun: DDP hands every rank the whole averaged gradient, and expert parallelism gives
    each rank whole experts, whose matrices Muon orthogonalises one by one, so 2 ranks take one process's
    steps. Not to float32's 1e-5: gradients summed in another order differ in their last bits, and the
    bf16 Newton-Schulz iteration rounds some entries the other way (the losses still agree to 1e-4 of
    the 0.1 they fall per step)."""
    muon = [*MOE, "--max-steps", "5", "--set", "optimizer=muon"]
    reference = train(work, "one-process-muon", [*muon, "--set", "grad_accum=2"])
    for name, spread in (("ddp", []), ("ep", ["--set", "expert_parallel=2"])):
        assert_same(train(work, f"two-muon-{name}", [*muon, *spread], ranks=2), reference, tol=5e-4)


def test_expert_parallel_with_replicas_on_four_ranks(work, moe_reference):
    """4 ranks, experts over 2: each expert shard lives on two ranks whose gradients must be summed, tensor for
    tensor, in the same order on both."""
    run = train(work, "four-ep", [*MOE, "--max-steps", "5", "--set", "batch_size=2", "--set", "expert_parallel=2"],
                ranks=4)
    reference = train(work, "one-process-moe-b2", [*MOE, "--max-steps", "5", "--set", "batch_size=2", "--set",
                                                   "grad_accum=4"])
    assert_same(run, reference)


def test_expert_parallel_pads_its_own_groups_in_bf16(work):
    """bf16 with 512 rows per expert takes the bucketed product, whose groups the experts module pads
    itself, per local expert, on the rows it received from the exchange. The products then group rows
    differently from one process's, so bf16 rounding differs: the losses must agree to 1e-2, not to
    float32's 1e-5."""
    bf16 = ["--preset", "tiny", "--set", "experts_per_token=2", "--set", "bf16=true", "--set", "batch_size=16",
            "--set", "seq_len=64", "--max-steps", "5"]
    one = train(work, "one-process-bf16", [*bf16, "--set", "grad_accum=2"])
    two = train(work, "two-ep-bf16", [*bf16, "--set", "expert_parallel=2"], ranks=2)
    (train_a, val_a), (train_b, val_b) = losses(two), losses(one)
    assert len(train_a) == len(train_b) == 5
    assert max(abs(a - b) for a, b in zip(train_a + val_a, train_b + val_b, strict=True)) <= 1e-2


@pytest.mark.parametrize("spread", [["--set", "parallel=fsdp", "--set", "expert_parallel=2"], []],
                         ids=["fsdp+ep", "ddp"])
def test_two_ranks_checkpoint_resumes_on_one(work, moe_reference, spread):
    run = train(work, f"two-then-one-{'-'.join(spread) or 'ddp'}", [*MOE, "--max-steps", "3", *spread], ranks=2)
    out = resume(work, run, 5, [], ranks=1)
    assert "grad_accum 1 -> 2" in out.stdout
    assert_same(run, moe_reference)


@pytest.mark.parametrize("spread", [["--set", "expert_parallel=2"], ["--set", "parallel=fsdp"]], ids=["ep", "fsdp"])
def test_one_process_checkpoint_resumes_on_two(work, moe_reference, spread):
    run = train(work, f"one-then-two-{spread[-1]}", [*MOE, "--max-steps", "3", "--set", "grad_accum=2"])
    out = resume(work, run, 5, spread, ranks=2)
    assert "grad_accum 2 -> 1" in out.stdout
    assert_same(run, moe_reference)
    # and the result is an ordinary run
    gen = launch(work, ["generate", str(run), "--prompt", "the ", "--max-new-tokens", "5", "--seed", "0"])
    assert gen.returncode == 0 and gen.stdout.startswith("the "), gen.stderr


def test_a_failing_rank_stops_the_run(work):
    t0 = time.perf_counter()
    out = launch(work, ["train", "--out", str(work["root"] / "fails"), "--data", str(work["corpus"]), *COMMON,
                        "--preset", "tiny", "--max-steps", "10"], ranks=2,
                 script=[str(Path(__file__).parent / "rank_fails.py")], env={"RANK_FAILS": "raise"}, timeout=120)
    took = time.perf_counter() - t0
    assert out.returncode != 0 and took < 60
    text = out.stdout + out.stderr
    assert "injected failure on rank 1 at step 3" in text
    assert "nanollama4 train (rank 0): error: a collective failed, most likely because another rank stopped" in text


def test_a_rank_that_stops_answering_times_out(work):
    """A peer that neither answers nor exits: rank 0's collective gives up after dist_timeout."""
    t0 = time.perf_counter()
    out = launch(work, ["train", "--out", str(work["root"] / "hangs"), "--data", str(work["corpus"]), *COMMON,
                        "--preset", "tiny", "--max-steps", "10", "--set", "dist_timeout=3"], ranks=2,
                 script=[str(Path(__file__).parent / "rank_fails.py")], env={"RANK_FAILS": "hang"}, timeout=170)
    took = time.perf_counter() - t0
    assert out.returncode != 0
    assert "nanollama4 train (rank 0): error: a collective failed" in out.stderr
    assert took < 60


@pytest.mark.parametrize("args, message", [
    (["--set", "expert_parallel=2"], "expert_parallel=2 needs a multiple of 2 processes (this run has 1)"),
    (["--set", "expert_parallel=3"], "expert_parallel=3 must divide n_experts (4)"),
    (["--set", "parallel=zero"], "parallel ('zero') must be 'ddp' or 'fsdp'"),
    (["--set", "dist_timeout=0"], "dist_timeout (0.0) must be a positive, finite number of seconds"),
    (["--set", "optimizer=muon", "--set", "parallel=fsdp"], "optimizer=muon with parallel=fsdp is not supported"),
])
def test_a_spread_that_cannot_work_is_one_line(work, args, message):
    run = work["root"] / "refused"
    out = launch(work, ["train", "--out", str(run), "--data", str(work["corpus"]), "--preset", "tiny",
                        "--max-steps", "2", *args])
    assert out.returncode == 2 and out.stderr.startswith(f"nanollama4 train: error: {message}")
    assert len(out.stderr.strip().splitlines()) == 1
    assert not run.exists()
