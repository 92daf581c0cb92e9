"""The training loop: exact resume (also after SIGTERM/SIGINT), one-line errors that never touch an existing
checkpoint, generation from a run, the full validation loss and the learning-rate schedule."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import nanollama4.training.train as train_mod
from nanollama4.base.config import TrainConfig, preset
from nanollama4.cli import EXIT_INTERRUPTED, main
from nanollama4.interop.checkpoint import CheckpointError, load_run, load_train_state, resolve_checkpoint
from nanollama4.model.transformer import Loss, Transformer
from nanollama4.ops import build_model
from nanollama4.training.evaluation import full_validation_loss
from nanollama4.training.runs import resume_config
from nanollama4.training.schedule import logged_lr, lr_scale
from nanollama4.training.train import TrainingError, train
from tests.helpers import (
    assert_cli_error,
    assert_one_line,
    assert_refused,
    host_reads,
    run_cli,
    snapshot,
    start_training,
    train_cli,
)


def cfg(**changes) -> TrainConfig:
    base = dict(seq_len=32, batch_size=4, eval_batches=2, eval_interval=3, warmup_steps=2, lr=3e-3, min_lr=3e-4)
    return TrainConfig.from_dict({**base, **changes})


def run_train(run_dir: Path, tc: TrainConfig, corpus: Path, cache: Path, model: dict | None = None, **kw):
    return train(preset("tiny", **(model or {})), tc, run_dir, data=str(corpus), progress=False, cache_dir=cache,
                 **kw)


# The tutorial's routing, as the demo trains (bias balancing) and more: learned noise draws from the global
# torch RNG, capacity reroutes, the bias is state outside the optimizer. Exact resume must restore all three.
TUTORIAL_ROUTING = dict(router="softmax", capacity_factor=1.0, bias_balance_rate=0.05, **{"softmax.noise": "learned"})
ROUTINGS = {"default": {}, "tutorial": TUTORIAL_ROUTING}


def resume(run_dir: Path, cache: Path, **overrides):
    return train(None, resume_config(run_dir, **overrides), run_dir, resume=True, progress=False, cache_dir=cache)


def train_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [x for x in lines if "lm_loss" in x]


def losses(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in train_lines(run_dir):
        assert line["step"] not in out, f"step {line['step']} logged twice in {run_dir}/metrics.jsonl"
        out[line["step"]] = line["lm_loss"]
    return out


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def work(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("train")
    return {"root": root, "corpus": corpus, "cache": root / "cache"}


@pytest.fixture
def cache_env(work, monkeypatch):
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(work["cache"]))
    return work["cache"]


# ---------------------------------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("routing,optimizer", [("default", "adamw"), ("tutorial", "adamw"), ("default", "muon"),
                                               ("default", "muon, AdamW experts"),
                                               ("default", "muon, experts in turn"),
                                               ("tutorial", "muon, experts in turn, saved with the old keys")])
def test_resume_is_exact(routing, optimizer, work, tmp_path):
    """Stopped at step k and resumed, a run logs the same losses and ends with the same weights as one that
    never stopped: with AdamW, with the tutorial's routing state, with Muon's momentum, and with Muon
    beside AdamW for the experts (muon.experts=False), and with the experts orthogonalised in turn (their last
    updates and the turn saved); and a run whose files spell the kinds' settings as runs did before the kinds
    owned them (muon_experts_per_step, router_noise)."""
    k = 6
    corpus, cache, model = work["corpus"], work["cache"], ROUTINGS[routing]
    a, b = tmp_path / "a", tmp_path / "b"
    in_turn = {"optimizer": "muon", "muon.experts_per_step": 1}
    chosen = {"muon, AdamW experts": {"optimizer": "muon", "muon.experts": False}, "muon, experts in turn": in_turn,
              "muon, experts in turn, saved with the old keys": in_turn}.get(optimizer, dict(optimizer=optimizer))
    run_train(a, cfg(max_steps=2 * k, **chosen), corpus, cache, model=model)
    first = run_train(b, cfg(max_steps=k, decay_steps=2 * k, **chosen), corpus, cache, model=model)
    assert first.step == k and not first.interrupted
    if "old keys" in optimizer:  # the checkpoint's files as an older nanollama4 wrote them
        last = resolve_checkpoint(b, prefer="last")
        for name in ("train_config.json", "config.json"):
            saved = json.loads((last / name).read_text())
            old = {key.replace("muon.", "muon_").replace("softmax.noise", "router_noise")
                   .replace("softmax.over", "softmax_over"): value for key, value in saved.items()}
            assert old != saved and all("." not in key for key in old)
            (last / name).write_text(json.dumps(old))
    second = resume(b, cache, max_steps=2 * k)
    assert second.step == 2 * k

    la, lb = losses(a), losses(b)  # losses() also fails on a step logged twice
    assert sorted(la) == sorted(lb) == list(range(1, 2 * k + 1))
    for step in range(1, 2 * k + 1):
        assert la[step] == lb[step], (step, la[step], lb[step])
    assert la[k + 1] != la[k]  # the losses change from step to step: the comparison means something
    lr_a = {x["step"]: x["lr"] for x in train_lines(a)}
    lr_b = {x["step"]: x["lr"] for x in train_lines(b)}
    assert lr_a == lr_b and len(set(lr_a.values())) > k  # the cosine schedule really moved

    ma, _, _ = load_run(a, prefer="last")
    mb, _, _ = load_run(b, prefer="last")
    sa, sb = ma.state_dict(), mb.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    if routing == "tutorial":  # the state that this routing adds really moved, so its restore was needed
        assert any(sa[n].abs().max() > 0 for n in sa if n.endswith("expert_bias")), "bias balancing never moved"
    # the validation loss at the end is the same too, and evaluation lines are not duplicated either
    val_steps = [json.loads(x)["step"] for x in (b / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert len(val_steps) == len(set(val_steps))
    assert first.val_loss is not None and second.val_loss is not None


def test_resume_refuses_another_optimizer(work, tmp_path):
    run = tmp_path / "adamw"
    run_train(run, cfg(max_steps=2), work["corpus"], work["cache"])
    before = snapshot(run)
    with pytest.raises(TrainingError, match="trained with optimizer=adamw, whose state muon cannot take over"):
        resume(run, work["cache"], max_steps=4, optimizer="muon")
    assert snapshot(run) == before
    muon = tmp_path / "muon"
    run_train(muon, cfg(max_steps=2, optimizer="muon"), work["corpus"], work["cache"])
    before = snapshot(muon)
    with pytest.raises(TrainingError, match="trained with muon.experts=True, whose expert state"):
        resume(muon, work["cache"], max_steps=4, **{"muon.experts": False})
    with pytest.raises(TrainingError, match="trained with muon.experts_per_step=0; a resume keeps it"):
        resume(muon, work["cache"], max_steps=4, **{"muon.experts_per_step": 1})
    assert snapshot(muon) == before


def _cli_train_cmd(corpus: Path, out: Path, max_steps: int, model: dict | None = None) -> list[str]:
    sets = ["seq_len=32", "batch_size=4", "eval_batches=2", "eval_interval=100000", "warmup_steps=2",
            "lr=0.003", "min_lr=0.0003", "threads=1"] + [f"{k}={v}" for k, v in (model or {}).items()]
    cmd = [sys.executable, "-m", "nanollama4.cli", "train", "--preset", "tiny", "--data", str(corpus),
           "--out", str(out), "--max-steps", str(max_steps), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def _interrupt_cli_run(corpus: Path, out: Path, cache: Path, sig: int, budget: int = 400,
                       model: dict | None = None) -> tuple[int, str, str]:
    env = {**os.environ, "NANOLLAMA4_CACHE": str(cache)}
    proc = subprocess.Popen(_cli_train_cmd(corpus, out, budget, model), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        metrics = out / "metrics.jsonl"
        while True:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                break
            assert proc.poll() is None, f"training ended before the signal: {proc.communicate()}"
            assert time.monotonic() < deadline, "no metrics after 60 s"
            time.sleep(0.02)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, stdout, stderr


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_sigterm_then_resume_matches_uninterrupted_run(routing, work, tmp_path):
    corpus, cache, model = work["corpus"], work["cache"], ROUTINGS[routing]
    run_c = tmp_path / "c"
    rc, out, err = _interrupt_cli_run(corpus, run_c, cache, signal.SIGTERM, model=model)
    assert rc == EXIT_INTERRUPTED, (rc, out, err)
    assert any("--resume" in line for line in out.splitlines()), out
    state, _ = load_train_state(resolve_checkpoint(run_c, prefer="last"))
    s = int(state["step"])
    assert 5 <= s < 400
    assert sorted(losses(run_c)) == list(range(1, s + 1))  # the checkpoint holds every step that was logged

    resumed = resume(run_c, cache, max_steps=s + 5, decay_steps=400)
    assert resumed.step == s + 5 and not resumed.interrupted
    ref = tmp_path / "ref"
    run_train(ref, cfg(max_steps=s + 5, decay_steps=400, eval_interval=100000, threads=1), corpus, cache, model=model)
    lc, lr = losses(run_c), losses(ref)
    assert sorted(lc) == sorted(lr) == list(range(1, s + 6))
    for step in range(1, s + 6):
        assert lc[step] == lr[step], (step, lc[step], lr[step])


def test_sigint_stops_cleanly_and_saves(work, tmp_path):
    run = tmp_path / "int"
    rc, out, err = _interrupt_cli_run(work["corpus"], run, work["cache"], signal.SIGINT)
    assert rc == EXIT_INTERRUPTED, (rc, out, err)
    assert "--resume" in out and "Traceback" not in err, (out, err)
    state, _ = load_train_state(resolve_checkpoint(run, prefer="last"))
    assert sorted(losses(run)) == list(range(1, int(state["step"]) + 1))


def test_signal_between_steps_still_saves_the_step_reached(work, tmp_path, monkeypatch):
    """A signal that lands after a step's checkpoint decision (here: during the progress-bar update) must
    still leave a checkpoint at the step the run stopped at, as the CLI's "stopped ... after saving" says."""
    real_tqdm = train_mod.tqdm

    class SignallingBar(real_tqdm):
        updates = 0

        def update(self, n=1):
            super().update(n)
            SignallingBar.updates += n
            if SignallingBar.updates == 3:
                signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(train_mod, "tqdm", SignallingBar)
    run = tmp_path / "sig"
    result = run_train(run, cfg(max_steps=50, eval_interval=100000), work["corpus"], work["cache"])
    assert result.interrupted and result.step == 3
    state, _ = load_train_state(resolve_checkpoint(run, prefer="last"))  # fails if nothing was saved
    assert int(state["step"]) == result.step


# ---------------------------------------------------------------------------------------------- errors
def _corrupt(kind: str, ckpt: Path) -> None:
    model = ckpt / "model.safetensors"
    if kind == "garbage-model":
        model.write_bytes(b"\x93NOT A SAFETENSORS FILE\x00\xff" * 200)
    elif kind == "truncated-model":
        data = model.read_bytes()
        model.write_bytes(data[: len(data) // 2])
    elif kind == "missing-model":
        model.unlink()
    elif kind == "corrupt-train-state":
        (ckpt / "train_state.json").write_text('{"step": 4, "rng": {"torch": "AAAA')
    elif kind == "missing-optimizer":
        (ckpt / "optimizer.safetensors").unlink()
    else:
        raise AssertionError(kind)


CORRUPTIONS = ["garbage-model", "truncated-model", "missing-model", "corrupt-train-state", "missing-optimizer"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_damaged_checkpoint_resume_is_one_line_error_and_changes_nothing(kind, tiny_run, work, tmp_path, capsys,
                                                                        cache_env):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, symlinks=True)
    _corrupt(kind, run / "step-0000004")
    before = snapshot(run)

    with pytest.raises(CheckpointError) as info:  # a ValueError: the CLI prints it as one line
        resume(run, work["cache"], max_steps=8)
    assert_one_line(info.value)
    assert snapshot(run) == before

    rc = main(["train", "--resume", str(run), "--max-steps", "8", "--quiet"])
    _, err = capsys.readouterr()
    assert_cli_error(rc, err, "train")
    assert snapshot(run) == before


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_damaged_checkpoint_generate_is_one_line_error_and_changes_nothing(kind, tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, symlinks=True)
    _corrupt(kind, run / "step-0000004")
    before = snapshot(run)
    model_damaged = kind.endswith("-model")

    if model_damaged:
        with pytest.raises(CheckpointError) as info:
            load_run(run)
        assert_one_line(info.value)
    rc = main(["generate", str(run), "--prompt", "the", "--max-new-tokens", "5", "--seed", "1"])
    out, err = capsys.readouterr()
    if model_damaged:
        assert_cli_error(rc, err, "generate")
    else:  # generation reads only the model, its config and the tokenizer: it must work
        assert rc == 0 and out.startswith("the") and err == "", (rc, out, err)
    assert snapshot(run) == before


def test_data_path_that_does_not_exist(work, tmp_path, capsys, cache_env):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError) as info:
        run_train(tmp_path / "r", cfg(max_steps=2), missing, work["cache"])
    assert "nope.txt" in assert_one_line(info.value)
    rc = main(["train", "--preset", "tiny", "--data", str(missing), "--out", str(tmp_path / "r2"), "--max-steps",
               "2", "--set", "seq_len=32", "--quiet"])
    assert "nope.txt" in assert_cli_error(rc, capsys.readouterr().err, "train")
    assert not list(tmp_path.glob("r*/step-*"))


@pytest.mark.parametrize("text", ["", "   \n\n", "tiny text."], ids=["empty", "blank", "too-short"])
def test_corpus_empty_or_too_short(text, work, tmp_path, capsys, cache_env):
    corpus = tmp_path / "small.txt"
    corpus.write_text(text)
    with pytest.raises(ValueError) as info:
        run_train(tmp_path / "r", cfg(max_steps=2), corpus, work["cache"])
    assert_one_line(info.value)
    rc = main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(tmp_path / "r2"), "--max-steps",
               "2", "--set", "seq_len=32", "--set", "batch_size=4", "--quiet"])
    assert_cli_error(rc, capsys.readouterr().err, "train")
    assert not list(tmp_path.glob("r*/step-*"))


def test_new_run_refuses_existing_run_dir(tiny_run, work, tmp_path, capsys, cache_env):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, symlinks=True)
    before = snapshot(run)
    with pytest.raises(TrainingError) as info:
        run_train(run, cfg(max_steps=2), work["corpus"], work["cache"])
    assert "--resume" in assert_one_line(info.value)
    assert snapshot(run) == before
    rc = main(["train", "--preset", "tiny", "--data", str(work["corpus"]), "--out", str(run), "--max-steps", "2",
               "--set", "seq_len=32", "--quiet"])
    assert "--resume" in assert_cli_error(rc, capsys.readouterr().err, "train")
    assert snapshot(run) == before


def test_non_finite_loss_stops_with_step_and_keeps_last_checkpoint(work, tmp_path, monkeypatch):
    run = tmp_path / "nan"
    real_loss = Transformer.loss
    seen = {"calls": 0, "snap": None}

    def loss(self, ids, targets):
        out = real_loss(self, ids, targets)
        if not self.training:
            return out
        seen["calls"] += 1
        if seen["calls"] == 4:  # the fourth training step: step 2's checkpoint and step 3's metrics are on disk
            seen["snap"] = snapshot(run)
            nan = out.lm * float("nan")
            return Loss(total=nan + out.aux, lm=nan, aux=out.aux)
        return out

    with monkeypatch.context() as patch, pytest.raises(TrainingError) as info:
        patch.setattr(Transformer, "loss", loss)
        run_train(run, cfg(max_steps=10, eval_interval=2), work["corpus"], work["cache"])
    msg = assert_one_line(info.value)
    assert "step 4" in msg, msg

    assert seen["snap"] is not None and snapshot(run) == seen["snap"]
    assert os.readlink(run / "last") == "step-0000002"
    model, tok, _ = load_run(run, prefer="last")
    assert isinstance(model, Transformer) and tok.vocab_size == model.cfg.vocab_size
    assert sorted(losses(run)) == [1, 2, 3]
    step3 = losses(run)[3]
    result = resume(run, work["cache"], max_steps=5)  # the saved checkpoint is good enough to continue from
    assert result.step == 5
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]  # step 3 was redone, and logged once
    assert losses(run)[3] == step3


def test_huge_learning_rate_raises_training_error(work, tmp_path):
    run = tmp_path / "huge"
    with pytest.raises(TrainingError) as info:
        run_train(run, cfg(max_steps=30, eval_interval=1, lr=1e6, min_lr=1e6, grad_clip=0.0, warmup_steps=0),
                  work["corpus"], work["cache"])
    msg = assert_one_line(info.value)
    assert "step" in msg
    failed_at = int(msg.split("at step ")[1].split(";")[0])
    assert os.readlink(run / "last") == f"step-{failed_at - 1:07d}"
    load_run(run, prefer="last")


# ---------------------------------------------------------------------------------------------- generate
def test_generate_prints_prompt_continuation_deterministically(tiny_run, capsys):
    args = ["generate", str(tiny_run), "--prompt", "the cat", "--max-new-tokens", "20", "--seed", "1"]
    assert main(args) == 0
    out1, err1 = capsys.readouterr()
    assert main(args) == 0
    out2, _ = capsys.readouterr()
    assert out1.startswith("the cat"), out1
    # char tokenizer: one character per token, plus print's newline; fewer where the row met the end-of-text
    # token, which a 4-step model has not yet learned never to draw
    assert len(out1) <= len("the cat") + 20 + 1
    assert out1 == out2 and err1 == ""
    assert main([*args, "--ignore-eos"]) == 0  # past it, every one of the 20 tokens is there (it reads as its name)
    going = capsys.readouterr().out[len("the cat"):-1]
    assert len(going.replace("<|end_of_text|>", "\0")) == 20


def test_generate_with_unknown_characters_is_one_line_error(tiny_run, capsys):
    rc = main(["generate", str(tiny_run), "--prompt", "Zebra\u20ac!", "--max-new-tokens", "5"])
    out, err = capsys.readouterr()
    line = assert_cli_error(rc, err, "generate")
    for ch in ("Z", "\u20ac", "!"):
        assert repr(ch) in line, line
    assert out == ""


# ---------------------------------------------------------------------------------------------- validation loss, lr
@pytest.mark.parametrize("n_tokens", [100, 97, 33])  # 99 predictions = 6*16 + 3; 96 = 6*16 (no partial); 32 = 2*16
def test_full_validation_loss_matches_window_by_window(n_tokens):
    torch.manual_seed(0)
    model = build_model(preset("tiny", vocab_size=40))
    tokens = np.random.default_rng(n_tokens).integers(0, 40, size=n_tokens).astype(np.uint16)
    seq_len = 16
    got = full_validation_loss(model, tokens, seq_len, torch.device("cpu"), batch_size=4)

    model.eval()
    ids = torch.from_numpy(tokens.astype(np.int64))
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n_tokens - 1, seq_len):
            t = min(seq_len, n_tokens - 1 - start)
            x, y = ids[start:start + t], ids[start + 1:start + t + 1]
            logits = model(x[None])[0]
            total += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
            count += t
    assert count == n_tokens - 1
    assert got == pytest.approx(total / count, abs=1e-5)


def lr_at(tc: TrainConfig, step: int, elapsed: float, step_time: float = 0.0) -> float:
    """The lr metrics.jsonl logs for a step: the schedule's share of tc.lr."""
    return logged_lr(tc, lr_scale(tc, step, elapsed, step_time))


def test_lr_at_warmup_and_cosine():
    lr, min_lr, warm = 1e-3, 1e-4, 10
    tc = TrainConfig(lr=lr, min_lr=min_lr, warmup_steps=warm, max_steps=110)

    def cosine(progress: float) -> float:
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))

    assert lr_at(tc, 0, 0.0) == pytest.approx(lr / warm)
    assert lr_at(tc, 4, 0.0) == pytest.approx(lr * 5 / warm)
    assert lr_at(tc, 9, 0.0) == pytest.approx(lr)
    assert lr_at(tc, 10, 0.0) == pytest.approx(lr)
    for step in (25, 60, 97):
        assert lr_at(tc, step, 0.0) == pytest.approx(cosine((step - warm) / 100))
    assert lr_at(tc, 60, 0.0) == pytest.approx((lr + min_lr) / 2)
    assert lr_at(tc, 110, 0.0) == pytest.approx(min_lr)
    assert lr_at(tc, 500, 0.0) == pytest.approx(min_lr)
    # decay_steps sets the horizon instead of max_steps (a run stopped early on plan)
    tc2 = TrainConfig(lr=lr, min_lr=min_lr, warmup_steps=warm, max_steps=20, decay_steps=210)
    assert lr_at(tc2, 15, 0.0) == pytest.approx(cosine(5 / 200))
    # a time budget: the schedule follows elapsed time, warmup_steps plays no part
    tc3 = TrainConfig(lr=lr, min_lr=min_lr, warmup_steps=1000, warmup_frac=0.0, max_time=100.0)
    assert lr_at(tc3, 3, 25.0) == pytest.approx(cosine(0.25))
    assert lr_at(tc3, 3, 200.0) == pytest.approx(min_lr)
    # ... and so does its warmup: a share of the budget, read at the step's expected end
    tc4 = TrainConfig(lr=lr, min_lr=min_lr, warmup_steps=1000, warmup_frac=0.2, max_time=100.0)
    assert lr_at(tc4, 0, 0.0, step_time=2.0) == pytest.approx(lr * 2 / 20)
    assert lr_at(tc4, 7, 9.0, step_time=1.0) == pytest.approx(lr / 2)
    assert lr_at(tc4, 7, 20.0) == pytest.approx(lr)
    assert lr_at(tc4, 7, 60.0) == pytest.approx(cosine(0.5))
    # both budgets: each phase ends with whichever budget reaches it first
    tc5 = TrainConfig(lr=lr, min_lr=min_lr, warmup_steps=10, warmup_frac=0.2, max_time=100.0, max_steps=110)
    assert lr_at(tc5, 9, 1.0) == pytest.approx(lr)
    assert lr_at(tc5, 0, 20.0) == pytest.approx(lr)
    assert lr_at(tc5, 60, 20.0) == pytest.approx(cosine(0.5))


@pytest.mark.parametrize("pause", [0.05, 0.25])
def test_time_budget_warmup_peaks_at_its_share_whatever_the_step_speed(pause, work, tmp_path, monkeypatch):
    """Steps slowed 5x apart: under --max-time the learning rate reaches its peak at warmup_frac of the
    budget in both runs (a step-counted warmup would end 5x later in the slow one)."""
    real_step = train_mod.train_step

    def slow_step(run, lr):
        time.sleep(pause)
        return real_step(run, lr)

    monkeypatch.setattr(train_mod, "train_step", slow_step)
    budget, frac, peak = 3.0, 0.4, 3e-3
    run_train(tmp_path / "r", cfg(max_time=budget, warmup_frac=frac, warmup_steps=2, lr=peak, eval_interval=100000),
              work["corpus"], work["cache"])
    lines = train_lines(tmp_path / "r")
    ends = [0.0] + [x["time"] for x in lines]  # ends[j]: the clock when step j ended (ends[0]: the start)
    i = next(j for j, x in enumerate(lines, 1) if x["lr"] == pytest.approx(peak, rel=1e-3))
    first_peak = lines[i - 1]

    def expected_end(j: int) -> float:  # what the schedule read for step j: its start + the step before's time
        return ends[j - 1] + (ends[j - 1] - ends[j - 2] if j >= 2 else 0.0)

    # The rule itself, read from the log (a bound of "one step either side" failed when one step ran slower than
    # the one before it): the first step at the peak expected to end at or past the share, the one before it
    # did not. Slack: a step starts a little after the previous one's logged end (the log write between them).
    slack = 0.05
    assert expected_end(i) >= frac * budget - slack, (first_peak, ends[:i + 1])
    assert i > 1 and expected_end(i - 1) < frac * budget + slack, (first_peak, ends[:i + 1])
    warming = [x for x in lines if x["time"] < first_peak["time"]]
    assert len(warming) >= 2 and all(x["lr"] < peak for x in warming)
    assert [x["lr"] for x in warming] == sorted(x["lr"] for x in warming)  # rising all the way


# ---------------------------------------------------------------------------------------------- torch.compile
@pytest.mark.compile
def test_compiled_training_matches_eager(work, tmp_path):
    """compile=true trains the same fp32 MoE model (its experts' grouped product cannot be traced in fp32,
    so compiled MoE layers take the per-expert loop); the losses agree with eager training step by step.
    Two layers, a chunked RoPE one (dense) and a NoPE one (MoE): each MoE layer breaks the graph at its
    experts, and every piece is compiled forward and backward, so each MoE layer more adds to the compile
    time (inductor compiles from nothing here) and says no more."""
    corpus, cache = work["corpus"], work["cache"]
    two = {"n_layers": 2, "nope_interval": 2, "moe_every": 2}
    run_train(tmp_path / "eager", cfg(max_steps=3, eval_interval=100), corpus, cache, model=two)
    run_train(tmp_path / "compiled", cfg(max_steps=3, eval_interval=100, compile=True), corpus, cache, model=two)
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(compiled) == [1, 2, 3]
    for step in (1, 2, 3):
        assert compiled[step] == pytest.approx(eager[step], abs=1e-4), step


# ------------------------------------------------------------------------------- divergence, presets, interruptions
@pytest.mark.parametrize("interval", [3, 1], ids=["before-any-checkpoint", "after-checkpoints"])
def test_a_diverging_run_never_saves_non_finite_weights(interval, corpus, tmp_path, capsys):
    """The issue's repro: lr 1e6 gives a NaN gradient norm at step 3 with a finite loss. That step used to be
    applied and saved (as `last` and `best`), so generate and resume failed deep inside torch."""
    run = tmp_path / "nan"
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(run), "--max-steps", "50",
                           "--set", "lr=1e6", "--set", f"eval_interval={interval}", "--set", "warmup_steps=0")
    line = assert_cli_error(rc, err, "train")
    if interval == 3:
        assert line == (f"nanollama4 train: error: the gradient norm became nan at step 3; the step's weights were "
                        f"not saved, no checkpoint was saved in {run} yet; lower lr (--set lr=...) and train again")
        assert not list(run.glob("step-*"))
        rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(run), "--max-steps", "2")
        assert rc == 0, err  # "train again" in the same folder works: it holds no run yet
        return
    assert line == (f"nanollama4 train: error: the gradient norm became nan at step 3; the step's weights were not "
                    f"saved, {run}/last (step-0000002) is intact; lower lr (--set lr=...) and continue with "
                    f"--resume {run}")
    for name in ("last", "best"):
        tensors = load_file(resolve_checkpoint(run, prefer=name) / "model.safetensors")
        assert all(torch.isfinite(t).all() for t in tensors.values()), name
    rc, out, err = run_cli(["generate", str(run), "--prompt", "the", "--max-new-tokens", "5"], capsys)
    assert rc == 0 and out.startswith("the"), err
    # two steps at lr 1e6 left weights of ~1e6 that overflow again whatever the lr: resuming fails the same
    # clear way and changes nothing (test_a_nan_gradient_... shows a resume that succeeds)
    before = snapshot(run)
    rc, _, err = run_cli(["train", "--resume", str(run), "--max-steps", "4", "--set", "lr=1e-3", "--quiet"], capsys)
    assert "the gradient norm became nan at step 3; the step's weights were not saved" in \
        assert_cli_error(rc, err, "train")
    assert snapshot(run) == before


def test_a_nan_gradient_with_a_finite_loss_is_not_saved_and_the_run_resumes(corpus, tmp_path, monkeypatch):
    """A NaN in one parameter's gradient (the loss stays finite) at step 4: the run stops as soon as the step's
    numbers are read (the step itself reads nothing back), before a checkpoint holds it, and the advised resume
    continues with the same losses as a run that never failed."""
    from nanollama4.training.runs import resume_config
    from nanollama4.training.train import TrainingError, train

    tc = TrainConfig(seq_len=32, batch_size=4, eval_batches=2, eval_interval=2, warmup_steps=2, max_steps=6,
                     threads=1)
    ref = train(preset("tiny"), tc, tmp_path / "ref", data=str(corpus), progress=False)
    real_loss = Transformer.loss
    calls = {"n": 0}

    def loss(self, ids, targets):
        out = real_loss(self, ids, targets)
        calls["n"] += self.training
        if self.training and calls["n"] == 4:  # 0 * sqrt(0) has value 0 and gradient NaN
            return dataclasses.replace(out, total=out.total + (self.embed.weight[0, 0] * 0).sqrt())
        return out

    run = tmp_path / "run"
    with monkeypatch.context() as patch, pytest.raises(TrainingError) as info:
        patch.setattr(Transformer, "loss", loss)
        train(preset("tiny"), tc, run, data=str(corpus), progress=False)
    assert str(info.value).startswith("the gradient norm became nan at step 4; the step's weights were not saved, ")
    assert os.readlink(run / "last") == "step-0000002"
    result = train(None, resume_config(run), run, resume=True, progress=False)
    assert result.step == 6
    model_ref, model = load_run(tmp_path / "ref", prefer="last")[0], load_run(run, prefer="last")[0]
    for (name, a), b in zip(model_ref.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert ref.step == 6


def test_a_preset_trains_with_default_settings(tmp_path, capsys):
    """`train --preset tiny --max-steps 3` used to fail: the default seq_len 128 exceeded tiny's context (64)."""
    run = tmp_path / "tiny"
    rc, out, err = run_cli(["train", "--preset", "tiny", "--max-steps", "3", "--out", str(run), "--quiet",
                            "--set", "batch_size=4", "--set", "threads=1"], capsys)
    assert rc == 0, err
    tc = load_run(run)[2]
    assert tc["seq_len"] == preset("tiny").max_seq_len == 64  # not given: follows the model's context


def test_an_interrupted_run_has_its_own_exit_status(corpus, tmp_path):
    """It used to exit 0 like a finished run."""
    run = tmp_path / "int"
    proc = start_training(corpus, run)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, (out, err)
    assert f"continue with: nanollama4 train --resume {run}" in out


def test_a_signal_before_the_first_checkpoint_says_nothing_was_saved(corpus, tmp_path, capsys, monkeypatch):
    """Exit status 3 promises a checkpoint to resume from; with none, the status is 130 and says so."""
    @contextlib.contextmanager
    def already_stopped():
        yield {"stop": True}

    monkeypatch.setattr(train_mod, "stop_on_signals", already_stopped)
    rc, out, err = train_cli(capsys, "--data", str(corpus), "--out", str(tmp_path / "r"), "--max-steps", "5")
    assert rc == 130, (out, err)
    assert "stopped by a signal before the first checkpoint; nothing was saved" in out
    assert "--resume" not in out


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux), which fails every write")
def test_a_metrics_write_that_fails_is_one_write_error(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    from nanollama4.base.errors import WriteError
    from nanollama4.training.metrics import MetricsFile

    with pytest.raises(WriteError) as info, MetricsFile(Path("/dev/full"), tmp_path) as metrics:
        metrics.write("{}\n")
        metrics.flush()
    assert str(info.value) == (f"cannot write /dev/full (no space left on the device); the last checkpoint in "
                               f"{tmp_path} is kept: make room and continue with --resume {tmp_path}")


# ---------------------------------------------------------------------------------------------- bf16=auto
@pytest.mark.parametrize("speedup,chosen", [(3.0, True), (0.6, False)])
def test_bf16_auto_is_decided_by_the_measured_speedup_and_saved(speedup, chosen, work, tmp_path, monkeypatch,
                                                                capsys):
    """bf16=auto turns into what the timing says (bf16 only where its products are BF16_PAYS times faster),
    says so in one line, and the run saves the decision, so a resumed run keeps its precision."""
    from nanollama4.base.runtime import Bf16Choice

    asked = []

    def timed(device, rows, d_in, d_out):
        asked.append((rows, d_in, d_out))
        return Bf16Choice.measured("AVX512_BF16", [speedup] * 3, [1.0] * 3)

    monkeypatch.setattr(train_mod, "bf16_speedup", timed)
    run = tmp_path / "run"
    run_train(run, cfg(max_steps=2, bf16="auto"), work["corpus"], work["cache"])
    tiny = preset("tiny")
    assert asked == [(4 * 32, tiny.d_model, 2 * tiny.expert_dim)]  # the run's rows, the widest FFN product
    assert f"bf16 products {speedup:.2f}x float32's (best of 3 interleaved pairs, pairs ranged " \
           f"{speedup:.2f}x-{speedup:.2f}x) -> {'bf16 autocast' if chosen else 'float32'}" in capsys.readouterr().out
    assert json.loads((run / "last" / "train_config.json").read_text())["bf16"] is chosen
    resume(run, work["cache"], max_steps=3)
    assert len(asked) == 1  # a resumed run keeps the saved choice: nothing timed again
    assert json.loads((run / "last" / "train_config.json").read_text())["bf16"] is chosen


def test_bf16_speedup_is_measured_on_this_cpu():
    from nanollama4.base.runtime import MIN_PAIRS, bf16_speedup

    choice = bf16_speedup(torch.device("cpu"), 256, 64, 128)
    assert choice.emulated or (math.isfinite(choice.speedup) and choice.speedup > 0 and choice.pairs >= MIN_PAIRS)


# ---------------------------------------------------------------------------------------------- before anything runs

def test_a_batch_that_cannot_fit_in_memory_is_one_line_before_anything_is_allocated(corpus, tmp_path, capsys):
    """`--set batch_size=100000000` used to be a MemoryError traceback from the batch sampler."""
    out = tmp_path / "run"
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(out), "--max-steps", "2",
                           "--set", "batch_size=100000000")
    line = assert_cli_error(rc, err, "train")
    assert re.search(r"a step of batch_size 100,000,000 x seq_len 32 needs about [\d.]+ [KMGT]iB .* [\d.]+ [KMGT]iB "
                     r"is free; pass --set batch_size=[\d,]+ or less", line), line
    fits = int(re.search(r"batch_size=([\d,]+) or less", line).group(1).replace(",", ""))
    assert 1_000 < fits < 100_000_000
    assert not out.exists()


def test_resuming_a_run_whose_saved_batch_cannot_fit_is_one_line(run_copy, capsys):
    """A train_config.json saying batch_size 1e9 used to get the process killed by the kernel (status 137)."""
    path = run_copy / "step-0000004" / "train_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "batch_size": 10**9}))
    line = assert_refused(capsys, ["train", "--resume", str(run_copy), "--max-steps", "8", "--quiet"], run_copy)
    assert "a step of batch_size 1,000,000,000 x seq_len 32 needs about" in line, line


def test_a_budget_of_years_is_refused_and_of_weeks_warned(corpus, tmp_path, capsys):
    """`--max-time 1e9h` used to train for days at a learning rate near zero (5% warm-up of the budget)."""
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(tmp_path / "a"), "--max-time", "1e9h")
    assert "duration '1e9h' is more than a year (8,784h)" in assert_cli_error(rc, err, "train")
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(tmp_path / "b"), "--max-time", "30d")
    assert rc == 2  # days are not a unit; weeks in hours are:
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(tmp_path / "b"), "--max-time", "400h",
                           "--set", "batch_size=100000000")
    assert err.startswith("warning: --max-time 16.7 days: the learning rate follows the whole budget (its warm-up "
                          "alone lasts 20.0 h)"), err


def test_a_thread_count_past_what_serve_takes_is_refused_before_the_run_starts(corpus, run_copy, tmp_path):
    """`--set threads=100000` crashed the process in torch.set_num_threads (SIGSEGV, status 139) after the run
    folder was locked, leaving run.lock; bounded at 1,024 as `serve --threads` is, it is one line. In a process
    of its own: the crash is what is tested."""
    words = "must be a whole number from 0 (all cores, watched) to 1,024"
    path = run_copy / "step-0000004" / "train_config.json"  # a saved config that says it is refused the same way
    path.write_text(json.dumps({**json.loads(path.read_text()), "threads": 100_000}))
    before = snapshot(run_copy, lock=True)
    for argv in (["--preset", "tiny", "--data", str(corpus), "--out", str(tmp_path / "r"), "--set", "threads=100000"],
                 ["--resume", str(run_copy)]):
        done = subprocess.run([sys.executable, "-m", "nanollama4.cli", "train", *argv, "--max-steps", "8", "--quiet"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (done.returncode, done.stderr)
        assert done.stderr.startswith("nanollama4 train: error: ") and f"threads (100000) {words}" in done.stderr
    assert not (tmp_path / "r").exists() and snapshot(run_copy, lock=True) == before


def test_the_summary_names_the_router_and_the_tokenizer_the_weights_came_with():
    """A fine-tune (--init-from, LoRA or not) of a BPE model said "char vocabulary": the summary read the run's
    tokenizer setting (char by default) instead of the tokenizer the weights brought. It also left the router
    kind out, and a shared expert of its own width looked like the routed experts' one."""
    from types import SimpleNamespace

    from nanollama4.model.tokenizer import BPETokenizer
    from nanollama4.training.distributed import World

    tok = BPETokenizer.train("naïve café, déjà vu " * 50, vocab_size=260)
    cfg = preset("tiny", vocab_size=tok.vocab_size, router="softmax", **{"softmax.noise": "learned"})
    tc = TrainConfig(init_from="runs/bpe", lora_rank=2, max_steps=3, seq_len=32)
    run = SimpleNamespace(model=Transformer(cfg), tc=tc, dataset=SimpleNamespace(n_train=900, n_val=100),
                          data="/corpus.txt", tokenizer=tok, dir=Path("runs/x"), step=0)
    text = train_mod.run_summary(run, World())
    assert f"; bpe vocabulary of {tok.vocab_size:,};" in text and "char vocabulary" not in text
    assert "4 experts top-2 + shared, softmax router (softmax.noise=learned))" in text
    run.model = Transformer(preset("tiny", vocab_size=tok.vocab_size, expert_dim=32, shared_expert_dim=64))
    assert "4 experts top-2 + shared of width 64, sigmoid router)" in train_mod.run_summary(run, World())


def test_the_suggested_prompt_is_the_start_of_a_line_of_the_runs_own_text():
    """The closing `next:` line suggested "ROMEO:" whatever the corpus: now the default corpus's prompt stays, and
    another corpus gives the start of the first whole line of its validation text (cut at a space), or none."""
    from types import SimpleNamespace

    from nanollama4.model.tokenizer import CharTokenizer

    def prompt_of(val_text: str, data: str | None = "/corpus.txt") -> str | None:
        tok = CharTokenizer.from_text(val_text + "x")
        dataset = SimpleNamespace(split_tokens=lambda split: np.array(tok.encode(val_text)))
        return train_mod.suggested_prompt(SimpleNamespace(data=data, tokenizer=tok, dataset=dataset))

    assert prompt_of("anything\nat all\n", data=None) == "ROMEO:"
    assert prompt_of("d-line\n\n   def forward(self, x_TD, token_A, expert_A):\n") == "def forward(self, x_TD,"
    assert prompt_of("ne\nshort\n") == "short"
    assert prompt_of("one long line without any newline in it at all") is None


# ------------------------------------------------------------------------------- a step reads nothing back
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_a_training_step_reads_no_tensor_back(optimizer, corpus, tmp_path):
    """The demo's step (its model, bf16, Muon with two experts a step, or AdamW) with the routed product a GPU
    takes (torch's grouped_mm, offsets on the device): under the profiler and a Tensor-method spy
    (`helpers.host_reads`), nothing in `train_step` reads a value back. Allowed, each for its reason: the
    sampler's window starts (drawn on the CPU by design, from the generator a resume restores), and reads
    inside two of torch's own CPU kernels, which their CUDA kernels do on the device: fused AdamW's step
    counters and grouped_mm's offsets. `read_step`, outside the step, then reads the step's numbers once."""
    from nanollama4.training.runsetup import start_run
    from nanollama4.training.train import read_step, train_step

    tc = TrainConfig(bf16=True, seq_len=64, batch_size=4, optimizer=optimizer, lr=2e-3, min_lr=2e-4, threads=1,
                     settings={"muon": {"experts_per_step": 2}})
    run = start_run(preset("shakespeare-char"), tc, tmp_path / "run", str(corpus), None)
    for moe in run.model.moe_layers():
        moe.experts.dispatch = "grouped"
    for _ in range(3):  # past the first steps (optimizer state made, products chosen)
        read_step(run, train_step(run, 1.0))
    reads = host_reads(lambda: [train_step(run, 1.0) for _ in range(2)])
    inside_torch = tuple(f"aten::{op} in aten::{kernel}" for op in ("item", "_local_scalar_dense")
                         for kernel in ("_fused_adamw_", "_grouped_mm"))
    assert [r for r in reads if not r.startswith(("Tensor.tolist at training/data.py", *inside_torch))] == []
    assert any(r.startswith("Tensor.tolist at training/data.py") for r in reads)  # the spy sees reads where they are
    result = read_step(run, train_step(run, 1.0))
    assert math.isfinite(result.lm) and result.grad_norm > 0 and result.counts.shape == (4, 8)


def test_the_cpu_products_read_only_their_group_sizes(corpus, tmp_path):
    """With the products "auto" picks on a CPU, the one extra read is the bucketed loop's group sizes (a
    CPU-only product: one torch.mm per expert needs each group's size on the host); the compiled kernel reads
    its counts in C++, which is not a tensor read (no device to wait for); and where auto picks torch's
    grouped_mm (an AVX2-only CPU, without the bf16 kernel), torch's own CPU kernel reads its offsets."""
    from nanollama4.training.runsetup import start_run
    from nanollama4.training.train import read_step, train_step

    tc = TrainConfig(bf16=True, seq_len=64, batch_size=4, optimizer="muon", lr=2e-3, threads=1)
    run = start_run(preset("shakespeare-char"), tc, tmp_path / "run", str(corpus), None)
    for _ in range(2):
        read_step(run, train_step(run, 1.0))
    reads = host_reads(lambda: train_step(run, 1.0))
    inside_torch = tuple(f"aten::{op} in aten::{kernel}" for op in ("item", "_local_scalar_dense")
                         for kernel in ("_fused_adamw_", "_grouped_mm"))
    allowed = ("Tensor.tolist at training/data.py", "Tensor.tolist at ops/experts.py", *inside_torch)
    assert [r for r in reads if not r.startswith(allowed)] == []
