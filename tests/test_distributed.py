"""torchrun training on 2 CPU processes (gloo, float32), through the CLI, against one process: data
parallel (DDP, FSDP2), checkpoints that move between world sizes, and a rank that fails or hangs.

A step of R ranks x batch b x accumulation a must be the step one process takes with batch b and
accumulation R x a: same windows, same micro-batches, same losses. The launching lives in torchrun.py;
expert parallelism in test_expert_parallel.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.torchrun import COMMON, MOE, assert_same, launch, new_work, resume, train


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return new_work(tmp_path_factory.mktemp("parallel"))


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
