"""Expert parallelism under torchrun: each MoE layer's experts split over ranks, rows exchanged all-to-all,
against one process (float32 to 1e-5; Muon and bf16 to the tolerances their tests give). The launching
lives in torchrun.py.
"""

from __future__ import annotations

import json

import pytest

from tests.torchrun import MOE, assert_same, losses, new_work, train


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return new_work(tmp_path_factory.mktemp("parallel"))


@pytest.fixture(scope="module")
def moe_reference(work):
    return train(work, "one-process-moe", [*MOE, "--max-steps", "5", "--set", "grad_accum=2"])


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
