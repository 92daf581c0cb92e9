"""The defects a new user hit (issue: Reliability), one test each: the exact one-line message, the exit
status, and that nothing else in the run directory changed."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import assert_cli_error, run_cli, snapshot, write_corpus
from nanollama4.checkpoint import CheckpointError, load_run, load_train_state, resolve_checkpoint, save_checkpoint
from nanollama4.config import TrainConfig, preset
from nanollama4.model import Transformer
from nanollama4.ops import build_model
from nanollama4.tokenizer import CharTokenizer
from nanollama4.train import make_optimizer

TINY = ["--preset", "tiny", "--set", "seq_len=32", "--set", "batch_size=4", "--set", "eval_batches=2",
        "--set", "threads=1", "--set", "warmup_steps=2", "--quiet"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch) -> Path:
    path = tmp_path_factory.getbasetemp() / "token-cache"
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    env = {**os.environ, "NANOLLAMA4_CACHE": str(tmp_path_factory.getbasetemp() / "token-cache")}
    code = subprocess.run([sys.executable, "-m", "nanollama4.cli", "train", *TINY, "--data", str(corpus),
                           "--out", str(run), "--max-steps", "4", "--set", "eval_interval=2"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert code.returncode == 0, code.stderr
    return run


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A private copy of the finished run."""
    copy = tmp_path / "run"
    shutil.copytree(finished, copy, symlinks=True)
    return copy


def train_cli(capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(["train", *TINY, *args], capsys)


# ---------------------------------------------------------------------------------------------- 1. non-finite
@pytest.mark.parametrize("interval", [3, 1], ids=["before-any-checkpoint", "after-checkpoints"])
def test_a_diverging_run_never_saves_non_finite_weights(interval, corpus, tmp_path, capsys):
    """The issue's repro: lr 1e6 gives a NaN gradient norm at step 3 with a finite loss. That step used to be
    applied and saved (as `last` and `best`), so generate and resume failed deep inside torch."""
    run = tmp_path / "nan"
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(run), "--max-steps", "50",
                           "--set", "lr=1e6", "--set", f"eval_interval={interval}", "--set", "warmup_steps=0")
    line = assert_cli_error(rc, err, "train")
    if interval == 3:
        assert line == (f"nanollama4 train: error: the gradient norm became nan at step 3; the step was not "
                        f"applied, no checkpoint was saved in {run} yet; lower lr (--set lr=...) and train again")
        assert not list(run.glob("step-*"))
        rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(run), "--max-steps", "2")
        assert rc == 0, err  # "train again" in the same folder works: it holds no run yet
        return
    assert line == (f"nanollama4 train: error: the gradient norm became nan at step 3; the step was not applied, "
                    f"{run}/last (step-0000002) is intact; lower lr (--set lr=...) and continue with "
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
    assert "the gradient norm became nan at step 3; the step was not applied" in assert_cli_error(rc, err, "train")
    assert snapshot(run) == before


def test_a_nan_gradient_with_a_finite_loss_is_not_applied_and_the_run_resumes(corpus, tmp_path, monkeypatch):
    """A NaN in one parameter's gradient (the loss stays finite) at step 4: nothing of it reaches the weights
    or a checkpoint, and the advised resume continues with the same losses as a run that never failed."""
    from nanollama4.runs import resume_config
    from nanollama4.train import TrainingError, train

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
    assert str(info.value).startswith("the gradient norm became nan at step 4; the step was not applied, ")
    assert os.readlink(run / "last") == "step-0000002"
    result = train(None, resume_config(run), run, resume=True, progress=False)
    assert result.step == 6
    model_ref, model = load_run(tmp_path / "ref", prefer="last")[0], load_run(run, prefer="last")[0]
    for (name, a), b in zip(model_ref.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert ref.step == 6


def test_save_checkpoint_refuses_non_finite_tensors(tmp_path):
    model = build_model(preset("tiny"))
    optimizer = make_optimizer(model, TrainConfig())
    with torch.no_grad():
        model.blocks[1].attn.q_proj.weight[0, 0] = float("inf")
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 7, model, optimizer, tok.save, {}, {"data": None}, {"t": torch.zeros(1)})
    assert str(info.value) == (f"step 7 not saved: blocks.1.attn.q_proj.weight holds non-finite values; the last "
                               f"checkpoint in {tmp_path} is kept")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["generate", "eval", "resume"])
def test_loading_non_finite_weights_is_one_line_naming_the_file(command, run, capsys):
    """A checkpoint written by an older version (or edited by hand) with NaN weights."""
    target = resolve_checkpoint(run, prefer="last")
    tensors = load_file(target / "model.safetensors")
    tensors["norm.weight"] = tensors["norm.weight"] * float("nan")
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    (run / "best").unlink()  # both links at the poisoned folder
    (run / "best").symlink_to(target.name)
    before = snapshot(run, lock=True)
    argv = {"generate": ["generate", str(run), "--prompt", "the"], "eval": ["eval", str(run)],
            "resume": ["train", "--resume", str(run), "--max-steps", "8", "--quiet"]}[command]
    rc, _, err = run_cli(argv, capsys)
    line = assert_cli_error(rc, err, argv[0])
    assert line.endswith(f"{target / 'model.safetensors'} holds non-finite values (in norm.weight); the run "
                         "diverged before this was saved: use an earlier checkpoint"), line
    assert snapshot(run) == {k: v for k, v in before.items() if k != "run.lock"}


# ---------------------------------------------------------------------------------------------- 2. one owner
def _start_training(corpus: Path, run: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanollama4.cli", "train", *TINY, "--data", str(corpus), "--out", str(run),
           "--max-steps", "100000", "--set", "eval_interval=5", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / "last").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint after 120 s"
        time.sleep(0.05)
    return proc


def test_a_second_training_on_the_same_folder_stops_at_once_naming_the_holder(corpus, tmp_path, capsys):
    """Two trainings on one --out used to both run and exit 0, their metrics interleaved."""
    run = tmp_path / "busy"
    proc = _start_training(corpus, run)
    try:
        holder = (run / "run.lock").read_text().strip()
        assert holder.startswith(f"pid {proc.pid} on {socket.gethostname()}, since "), holder
        for argv in (["train", "--resume", str(run), "--max-time", "3", "--quiet"],  # short, should it run
                     ["train", *TINY, "--data", str(corpus), "--out", str(run), "--max-steps", "3"]):
            start = time.monotonic()
            rc, _, err = run_cli(argv, capsys)
            assert assert_cli_error(rc, err, "train") == (
                f"nanollama4 train: error: {run} is in use by another training ({holder}); wait for it to "
                "finish, or stop it, or train in another --out")
            assert time.monotonic() - start < 5  # at once: before reading any data
            assert (run / "run.lock").read_text().strip() == holder  # the refused process wrote nothing
    finally:
        proc.kill()  # a crash: the kernel releases the lock with the process
        proc.communicate()
    state, _ = load_train_state(resolve_checkpoint(run))
    rc, _, err = run_cli(["train", "--resume", str(run), "--max-steps", str(state["step"] + 1), "--quiet"], capsys)
    assert rc == 0, err
    assert (run / "run.lock").read_text().startswith(f"pid {os.getpid()} ")


# ---------------------------------------------------------------------------------------------- 3. --out
def test_out_into_a_folder_that_is_not_a_run_is_refused(corpus, tmp_path, capsys):
    """It used to overwrite the folder's metrics.jsonl and plots/loss.png."""
    folder = tmp_path / "mine"
    (folder / "plots").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"my": "numbers"}\n')
    (folder / "plots" / "loss.png").write_bytes(b"my picture")
    before = snapshot(folder, lock=True)
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(folder), "--max-steps", "2")
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: {folder} is not empty (2 entries, e.g. 'metrics.jsonl') and is not a training "
        "run; pass a new or empty folder as --out")
    assert snapshot(folder, lock=True) == before


def test_out_that_is_a_file_is_one_line(corpus, tmp_path, capsys):
    """It used to give a Python traceback after loading the data."""
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(target), "--max-steps", "2")
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: --out {target} is a file, not a folder; pass a new or empty folder")
    assert target.read_text() == "keep me"


def test_an_empty_folder_is_a_fine_out(corpus, tmp_path, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(folder), "--max-steps", "2")
    assert rc == 0, err
    assert (folder / "last").exists()


# ---------------------------------------------------------------------------------------------- 4. paths on resume
def test_a_run_with_a_relative_data_path_resumes_and_evaluates_from_anywhere(corpus, tmp_path, capsys,
                                                                             monkeypatch):
    """--data data/small.txt used to be stored as typed, so resume and eval failed from another folder."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    (here / "data").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(corpus, here / "data" / "small.txt")
    monkeypatch.chdir(here)
    rc, _, err = train_cli(capsys, "--data", "data/small.txt", "--out", "runs/r", "--max-steps", "2")
    assert rc == 0, err
    state, _ = load_train_state(resolve_checkpoint(here / "runs" / "r"))
    assert state["data"] == str(here / "data" / "small.txt")
    monkeypatch.chdir(elsewhere)
    rc, _, err = run_cli(["train", "--resume", "../here/runs/r", "--max-steps", "3", "--quiet"], capsys)
    assert rc == 0, err
    rc, out, err = run_cli(["eval", "../here/runs/r"], capsys)
    assert rc == 0 and "full validation loss" in out, err


def test_resume_takes_data_at_a_new_path_and_checks_it_against_the_tokenizer(run, corpus, tmp_path, capsys):
    moved = tmp_path / "moved.txt"
    shutil.move(corpus, moved)
    try:
        before = snapshot(run)
        rc, _, err = run_cli(["train", "--resume", str(run), "--max-steps", "6", "--quiet"], capsys)
        assert assert_cli_error(rc, err, "train") == (
            f"nanollama4 train: error: {run} was trained on {corpus}, which no longer exists; pass --data PATH "
            "with the same text")
        assert snapshot(run) == before

        foreign = tmp_path / "foreign.txt"
        foreign.write_text(moved.read_text() + "Zebra!\n")
        rc, _, err = run_cli(["train", "--resume", str(run), "--data", str(foreign), "--max-steps", "6",
                              "--quiet"], capsys)
        line = assert_cli_error(rc, err, "train")
        assert line == (f"nanollama4 train: error: the run's tokenizer cannot encode the corpus {foreign}: it has "
                        "2 characters not in the vocabulary: '!', 'Z'; resume on the text the run was trained on")
        assert snapshot(run) == before

        rc, _, err = run_cli(["train", "--resume", str(run), "--data", str(moved), "--max-steps", "6", "--quiet"],
                             capsys)
        assert rc == 0, err
        state, _ = load_train_state(resolve_checkpoint(run))
        assert state["step"] == 6 and state["data"] == str(moved)
    finally:
        shutil.move(moved, corpus)


@pytest.mark.parametrize(("extra", "refused"), [
    (["--out", "elsewhere"], "--out"),
    (["--preset", "tiny"], "--preset"),
    (["--set", "n_layers=2"], "--set n_layers"),
    (["--set", "seed=3"], "--set seed"),
    (["--set", "tokenizer=bpe"], "--set tokenizer"),
])
def test_resume_refuses_options_it_cannot_honour(extra, refused, run, capsys):
    """--data and --out given with --resume used to be silently ignored."""
    before = snapshot(run, lock=True)
    rc, _, err = run_cli(["train", "--resume", str(run), "--max-steps", "8", "--quiet", *extra], capsys)
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: {refused} cannot change on --resume: the run keeps its directory, model, "
        "tokenizer and seed (start a new run with --out for that)")
    assert snapshot(run, lock=True) == before


def test_resume_with_a_budget_already_spent_is_refused(run, capsys):
    """--max-steps 2 on a run at step 4 used to do nothing and report success."""
    before = snapshot(run, lock=True)
    rc, _, err = run_cli(["train", "--resume", str(run), "--max-steps", "2", "--quiet"], capsys)
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: {run} is already at step 4 and --max-steps counts the whole run; pass "
        "--max-steps above 4 (or --max-time)")
    rc, _, err = run_cli(["train", "--resume", str(run), "--quiet"], capsys)  # the saved budget: also spent
    assert assert_cli_error(rc, err, "train").endswith("pass --max-steps above 4 (or --max-time)")
    assert snapshot(run) == {k: v for k, v in before.items() if k != "run.lock"}


# ---------------------------------------------------------------------------------------------- 5-6. values
@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "RUN", "--top-p", "0"],
     "argument --top-p: '0' must be in (0, 1]: the probability mass to sample from"),
    (["generate", "RUN", "--top-p", "-0.5"],
     "argument --top-p: '-0.5' must be in (0, 1]: the probability mass to sample from"),
    (["generate", "RUN", "--top-p", "2"],
     "argument --top-p: '2' must be in (0, 1]: the probability mass to sample from"),
    (["generate", "RUN", "--temperature", "nan"], "argument --temperature: 'nan' is not a finite number"),
    (["generate", "RUN", "--temperature", "-1"], "argument --temperature: '-1' must be 0 (greedy) or more"),
    (["generate", "RUN", "--max-new-tokens", "-5"], "argument --max-new-tokens: '-5' must be at least 1"),
    (["generate", "RUN", "--top-k", "0"], "argument --top-k: '0' must be at least 1"),
    (["train", "--max-time", "nan", "--out", "X"],
     "argument --max-time: duration 'nan' must be a positive time such as 300, 300s, 10m or 1.5h"),
])
def test_sampling_and_budget_values_are_checked_at_the_boundary(argv, message, finished, tmp_path, capsys):
    argv = [str(finished) if a == "RUN" else str(tmp_path / "x") if a == "X" else a for a in argv]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and err.strip() == f"nanollama4 {argv[0]}: error: {message} (see nanollama4 {argv[0]} --help)"


@pytest.mark.parametrize(("setting", "message"), [
    ("device=gpu", "device ('gpu') must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N a GPU index), 'mps' or 'xpu'"),
    ("vocab_size=5", "vocab_size cannot be set: it is the tokenizer's (char: the corpus's characters; bpe: "
                     "--set bpe_vocab_size=N)"),
])
def test_train_settings_are_checked_before_anything_is_written(setting, message, corpus, tmp_path, capsys):
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(tmp_path / "r"), "--max-steps", "2",
                           "--set", setting)
    assert assert_cli_error(rc, err, "train") == f"nanollama4 train: error: {message}"
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch without CUDA")
def test_cuda_on_a_cpu_only_torch_is_one_line(corpus, tmp_path, capsys):
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(tmp_path / "r"), "--max-steps", "2",
                           "--set", "device=cuda")
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: device 'cuda' is not available: this torch ({torch.__version__}) sees no CUDA "
        "GPU; use --set device=cpu (or auto)")


# ---------------------------------------------------------------------------------------------- 7. presets
def test_a_preset_trains_with_default_settings(tmp_path, capsys):
    """`train --preset tiny --max-steps 3` used to fail: the default seq_len 128 exceeded tiny's context (64)."""
    run = tmp_path / "tiny"
    rc, out, err = run_cli(["train", "--preset", "tiny", "--max-steps", "3", "--out", str(run), "--quiet",
                            "--set", "batch_size=4", "--set", "threads=1"], capsys)
    assert rc == 0, err
    tc = load_run(run)[2]
    assert tc["seq_len"] == preset("tiny").max_seq_len == 64  # not given: follows the model's context


# ---------------------------------------------------------------------------------------------- 9. smaller ones
def test_an_interrupted_run_has_its_own_exit_status(corpus, tmp_path):
    """It used to exit 0 like a finished run."""
    run = tmp_path / "int"
    proc = _start_training(corpus, run)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, (out, err)
    assert f"continue with: nanollama4 train --resume {run}" in out


def test_generate_can_replace_unknown_characters(finished, capsys):
    rc, _, err = run_cli(["generate", str(finished), "--prompt", "The CAT", "--max-new-tokens", "3"], capsys)
    line = assert_cli_error(rc, err, "generate")
    assert line.endswith("substitute a character that is in it (--replace-unknown '?' on the command line, "
                         "replace='?' in Python)"), line
    rc, _, err = run_cli(["generate", str(finished), "--prompt", "The CAT", "--replace-unknown", "?"], capsys)
    assert assert_cli_error(rc, err, "generate").endswith(
        "replacement '?' is not in the vocabulary; pick a character that is (e.g. ' ' or '?')")
    rc, out, err = run_cli(["generate", str(finished), "--prompt", "The CAT", "--replace-unknown", " ",
                            "--max-new-tokens", "3"], capsys)
    assert rc == 0 and out.startswith("The CAT") and len(out) == len("The CAT") + 3 + 1, (out, err)


def test_a_checkpoint_without_config_json_is_named(run, capsys):
    """It used to say "no last/ or best/" although last/ was there."""
    target = resolve_checkpoint(run, prefer="last")
    (target / "config.json").unlink()
    (run / "best").unlink()
    (run / "best").symlink_to(target.name)
    rc, _, err = run_cli(["generate", str(run), "--prompt", "the"], capsys)
    assert assert_cli_error(rc, err, "generate") == (
        f"nanollama4 generate: error: {run / 'best'} ({target.name}) has no config.json; the checkpoint is "
        "incomplete: restore the file or use another checkpoint")


def test_a_latin1_corpus_is_an_error_unless_replacing_is_asked_for(tmp_path, capsys):
    """é in a Latin-1 file used to become U+FFFD without a word."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes(("the caf\u00e9 " * 400).encode("latin-1"))
    rc, _, err = train_cli(capsys, "--data", str(latin), "--out", str(tmp_path / "r"), "--max-steps", "2")
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: {latin} is not UTF-8 text (byte 0xe9 at offset 7); convert it to UTF-8, or pass "
        "--set invalid_utf8=replace to read such bytes as U+FFFD")
    rc, _, err = train_cli(capsys, "--data", str(latin), "--out", str(tmp_path / "r"), "--max-steps", "2",
                           "--set", "invalid_utf8=replace")
    assert rc == 0, err
    assert "\ufffd" in load_run(tmp_path / "r")[1].chars
    rc, out, err = run_cli(["eval", str(tmp_path / "r")], capsys)  # eval reads it the same way
    assert rc == 0, err


def test_resume_with_seq_len_none_follows_the_model(run, capsys):
    """None means "the model's context" on resume too (it reached `None > int` inside train)."""
    rc, _, err = run_cli(["train", "--resume", str(run), "--max-steps", "5", "--set", "seq_len=None", "--quiet"],
                         capsys)
    assert rc == 0, err
    assert load_run(run, prefer="last")[2]["seq_len"] == preset("tiny").max_seq_len


def test_a_signal_before_the_first_checkpoint_says_nothing_was_saved(corpus, tmp_path, capsys, monkeypatch):
    """Exit status 3 promises a checkpoint to resume from; with none, the status is 130 and says so."""
    import contextlib

    import nanollama4.train as train_mod

    @contextlib.contextmanager
    def already_stopped():
        yield {"stop": True}

    monkeypatch.setattr(train_mod, "stop_on_signals", already_stopped)
    rc, out, err = train_cli(capsys, "--data", str(corpus), "--out", str(tmp_path / "r"), "--max-steps", "5")
    assert rc == 130, (out, err)
    assert "stopped by a signal before the first checkpoint; nothing was saved" in out
    assert "--resume" not in out


def test_atomic_writes_keep_the_file_mode(tmp_path):
    """mkstemp makes private files: a resumed run's metrics.jsonl used to become 0600."""
    from nanollama4.files import atomic_write

    fresh, kept = tmp_path / "fresh.txt", tmp_path / "kept.txt"
    kept.write_text("old")
    kept.chmod(0o640)
    for path in (fresh, kept):
        atomic_write(path, lambda p: Path(p).write_text("new"))
    assert (fresh.stat().st_mode & 0o777, kept.stat().st_mode & 0o777) == (0o644, 0o640)
    assert kept.read_text() == "new"
