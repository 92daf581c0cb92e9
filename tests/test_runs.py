"""Run directories (nanollama4.training.runs): one owner at a time, what --out may be, and what --resume may change
and where it finds its data again. Each test checks the exact one-line message, the exit status, and that
nothing else in the folder changed."""

from __future__ import annotations

import os
import shutil
import socket
import time

import pytest

from nanollama4.base.config import preset
from nanollama4.interop.checkpoint import load_run, load_train_state, resolve_checkpoint
from tests.helpers import TINY, assert_cli_error, assert_refused, run_cli, snapshot, start_training, train_cli

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py, as are corpus, tiny_run and run_copy


def test_a_second_training_on_the_same_folder_stops_at_once_naming_the_holder(corpus, tmp_path, capsys):
    """Two trainings on one --out used to both run and exit 0, their metrics interleaved."""
    run = tmp_path / "busy"
    proc = start_training(corpus, run)
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


def test_resume_takes_data_at_a_new_path_and_checks_it_against_the_tokenizer(run_copy, corpus, tmp_path, capsys):
    moved = tmp_path / "moved.txt"
    shutil.move(corpus, moved)
    try:
        before = snapshot(run_copy)
        rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "6", "--quiet"], capsys)
        assert assert_cli_error(rc, err, "train") == (
            f"nanollama4 train: error: {run_copy} was trained on {corpus}, which no longer exists; pass --data PATH "
            "with the same text")
        assert snapshot(run_copy) == before

        foreign = tmp_path / "foreign.txt"
        foreign.write_text(moved.read_text() + "Zebra!\n")
        rc, _, err = run_cli(["train", "--resume", str(run_copy), "--data", str(foreign), "--max-steps", "6",
                              "--quiet"], capsys)
        line = assert_cli_error(rc, err, "train")
        assert line == (f"nanollama4 train: error: the run's tokenizer cannot encode the corpus {foreign}: it has "
                        "2 characters not in the vocabulary: '!', 'Z'; resume on the text the run was trained on")
        assert snapshot(run_copy) == before

        rc, _, err = run_cli(["train", "--resume", str(run_copy), "--data", str(moved), "--max-steps", "6", "--quiet"],
                             capsys)
        assert rc == 0, err
        state, _ = load_train_state(resolve_checkpoint(run_copy))
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
def test_resume_refuses_options_it_cannot_honour(extra, refused, run_copy, capsys):
    """--data and --out given with --resume used to be silently ignored."""
    before = snapshot(run_copy, lock=True)
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "8", "--quiet", *extra], capsys)
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: {refused} cannot change on --resume: the run keeps its directory, model, "
        "tokenizer and seed (start a new run with --out for that)")
    assert snapshot(run_copy, lock=True) == before


def test_resume_with_a_budget_already_spent_is_refused(run_copy, capsys):
    """--max-steps 2 on a run at step 4 used to do nothing and report success."""
    before = snapshot(run_copy, lock=True)
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "2", "--quiet"], capsys)
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: {run_copy} is already at step 4 and --max-steps counts the whole run; pass "
        "--max-steps above 4 (or --max-time)")
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--quiet"], capsys)  # the saved budget: also spent
    assert assert_cli_error(rc, err, "train").endswith("pass --max-steps above 4 (or --max-time)")
    assert snapshot(run_copy) == {k: v for k, v in before.items() if k != "run.lock"}


def test_resume_with_seq_len_none_follows_the_model(run_copy, capsys):
    """None means "the model's context" on resume too (it reached `None > int` inside train)."""
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "5", "--set", "seq_len=None", "--quiet"],
                         capsys)
    assert rc == 0, err
    assert load_run(run_copy, prefer="last")[2]["seq_len"] == preset("tiny").max_seq_len


# ---------------------------------------------------------------------------------------------- no run inside a run
@pytest.mark.parametrize("inside", ["step-0000004", "last", "best"])
def test_resume_of_a_checkpoint_inside_a_run_is_refused(inside, run_copy, capsys):
    """`train --resume RUN/step-N` used to train a second run nested in the checkpoint folder, beside the first
    run's own training, whose pruning then deleted it with its steps."""
    line = assert_refused(capsys, ["train", "--resume", str(run_copy / inside), "--max-steps", "60", "--quiet"],
                          run_copy, lock=True)
    assert line == (f"nanollama4 train: error: {run_copy / inside} is a checkpoint inside the run {run_copy}, not a "
                    f"run; resume the run itself: --resume {run_copy} (it continues from {run_copy}/last)")


def test_a_new_run_inside_a_run_is_refused(corpus, run_copy, capsys):
    before = snapshot(run_copy, lock=True)
    for out in (run_copy / "step-0000004" / "sub", run_copy / "nested", run_copy / "step-0000004"):
        rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(out), "--max-steps", "2")
        line = assert_cli_error(rc, err, "train")
        assert f"{out} lies inside the run {run_copy}" in line or "is not empty" in line, line
    assert snapshot(run_copy, lock=True) == before


def test_a_checkpoint_folder_alone_is_not_resumed(run_copy, tmp_path, capsys):
    lone = tmp_path / "lone"
    shutil.copytree(run_copy / "step-0000004", lone)
    line = assert_refused(capsys, ["train", "--resume", str(lone), "--max-steps", "8", "--quiet"], lone, lock=True)
    assert line == (f"nanollama4 train: error: {lone} is a checkpoint folder, not a run directory; pass the run "
                    "directory that holds it to --resume")


# ---------------------------------------------------------------------------------------------- planted symlinks
@pytest.mark.parametrize(("planted", "message"), [
    ("run.lock", "is a symlink; a run's lock file is its own: remove the link"),
    ("metrics.jsonl", "is a symlink; nanollama4 writes only files it made: remove the link"),
])
def test_a_planted_symlink_is_never_written_through(planted, message, corpus, tmp_path, capsys):
    """A run.lock planted as a symlink made `train --out` truncate the file it pointed at; so did a
    metrics.jsonl link in a folder holding only run.lock (which makes it look like a run of ours)."""
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    folder = tmp_path / "trap"
    folder.mkdir()
    if planted == "metrics.jsonl":
        (folder / "run.lock").write_text("")
    (folder / planted).symlink_to(victim)
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(folder), "--max-steps", "2")
    assert assert_cli_error(rc, err, "train") == f"nanollama4 train: error: {folder / planted} {message}"
    assert victim.read_text() == "keep me"


def test_a_planted_metrics_symlink_is_refused_on_resume(run_copy, tmp_path, capsys):
    """--resume rewrote metrics.jsonl by replacing it: a planted link was silently replaced (docs/runs.md
    says it is an error), after its target had been read."""
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    metrics = run_copy / "metrics.jsonl"
    metrics.unlink()
    metrics.symlink_to(victim)
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "6", "--quiet"], capsys)
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: {metrics} is a symlink; nanollama4 writes only files it made: remove the link")
    assert metrics.is_symlink() and victim.read_text() == "keep me\n"
    assert os.readlink(run_copy / "last") == "step-0000004"


# ---------------------------------------------------------------------------------------------- refused runs
def test_a_refused_new_run_leaves_nothing_behind(tmp_path, capsys):
    """A run refused after its folder was made (here: a corpus too short for one window) used to leave the
    folder behind with its run.lock, which then made the folder look like a run."""
    short = tmp_path / "short.txt"
    short.write_text("a few words\n")
    out = tmp_path / "new" / "run"
    rc, _, err = train_cli(capsys, "--data", str(short), "--out", str(out), "--max-steps", "2")
    assert_cli_error(rc, err, "train")
    assert not out.exists()


def test_a_budget_that_ends_before_the_first_step_is_an_error_and_leaves_nothing(corpus, tmp_path, capsys):
    """`--max-time 1e-9` used to exit 0 with nothing saved, then suggest `generate` on the empty folder."""
    out = tmp_path / "r"
    rc, out_text, err = train_cli(capsys, "--data", str(corpus), "--out", str(out), "--max-time", "1e-9")
    assert assert_cli_error(rc, err, "train") == (
        "nanollama4 train: error: the budget ran out before the first step ended (--max-time 1e-09s); nothing was "
        "trained or saved: give a budget of at least one step")
    assert "generate" not in out_text
    assert not out.exists()


def _race_owning(base: str, rounds: int, barrier, results) -> None:
    """One of two racers (a spawned process): each round, open base/rN as a new run at the barrier's
    release; the winner checks that its folder stays whole while it holds it."""
    from pathlib import Path

    from nanollama4.base.errors import Nanollama4Error
    from nanollama4.training.distributed import World
    from nanollama4.training.runs import owning

    outcomes = []
    for i in range(rounds):
        run = Path(base) / f"r{i:03d}"
        barrier.wait()
        try:
            with owning(run, False, World()):
                (run / "marker").write_text(str(os.getpid()))
                time.sleep(0.02)  # a loser that removes the folder does it now
                intact = (run / "marker").read_text() == str(os.getpid()) and (run / "run.lock").is_file()
                outcomes.append("won" if intact else "won, but the folder was removed under it")
        except Nanollama4Error as e:
            outcomes.append(f"refused: {e}")
        except Exception as e:  # noqa: BLE001 - what the test must never see, reported rather than raised
            outcomes.append(f"crashed: {type(e).__name__}: {e}")
    results.put(outcomes)


def test_two_trainings_racing_for_fresh_folders_never_remove_the_winners(tmp_path):
    """The loser of the lock race used to remove the folder the winner was training in (it had created the
    folder too, as both saw it missing), or crash with a FileNotFoundError traceback."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    rounds, barrier, results = 60, ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_owning, args=(str(tmp_path), rounds, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    wins = 0
    for a, b in zip(*outcomes, strict=True):
        assert not any(o.startswith(("crashed", "won, but")) for o in (a, b)), (a, b)
        wins += (a == "won") + (b == "won")
        for o in (a, b):
            if o.startswith("refused"):
                assert "is in use by another training" in o or "was removed by another training" in o, o
    assert wins >= rounds  # every round someone trained
    from nanollama4.training.runs import holds_run

    # a folder is removed only by the process that created it and holds its lock; one whose creator lost the
    # race stays, empty of checkpoints: a new run may take it as its --out
    assert not any(holds_run(d) for d in tmp_path.iterdir())


@pytest.mark.parametrize(("value", "reason"), [
    ("lr=nan", "lr (nan) must be a non-negative number"),
    ("lr=-1", "lr (-1.0) must be a non-negative number"),  # shown as parsed: lr=-1.0
    ("eval_interval=0", "eval_interval (0) must be a positive integer"),
    ("grad_accum=0", "grad_accum (0) must be a positive integer"),
    ("muon.momentum=1.5", "muon.momentum (1.5) must be in [0, 1)"),
    ("warmup_frac=1", "warmup_frac (1.0) must be a share of the time budget in [0, 1)"),
])
def test_a_bad_value_on_resume_is_blamed_on_the_command_line_not_the_file(value, reason, run_copy, capsys):
    """`--resume RUN --set lr=nan` used to say "RUN: train_config.json is invalid (lr (nan) ...)"."""
    line = assert_refused(capsys, ["train", "--resume", str(run_copy), "--max-steps", "8", "--quiet",
                                   "--set", value], run_copy)
    key, _, raw = value.partition("=")
    shown = f"{key}={float(raw)}" if key in ("lr", "warmup_frac", "muon.momentum") else value
    assert line == (f"nanollama4 train: error: --set {shown} given on the command line: {reason} (the run's "
                    "train_config.json is fine; pass another value)"), line



def test_code_a_run_folder_names_for_its_optimizer_is_shown_escaped_and_said_to_come_from_it(run_copy, capsys):
    """Issue 55: the resume message printed a crafted train_config.json's optimizer_imports raw and advised
    --import of it as if the run were the user's own."""
    import json

    path = run_copy / "step-0000004" / "train_config.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "optimizer": "theirs", "optimizer_imports": "evil\x1b]0;title\x07"}))
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "6", "--quiet"], capsys)
    line = assert_cli_error(rc, err, "train")
    assert "\x1b" not in line and "\x07" not in line
    assert (f"optimizer 'theirs' is defined by code that the run folder {run_copy} names (evil\\x1b]0;title\\x07, "
            "in its train_config.json), which is not imported: pass --import evil\\x1b]0;title\\x07 if you trust "
            "that code") in line, line


def test_a_resume_cuts_metrics_lines_it_cannot_read_instead_of_failing(tmp_path):
    """Issue 55: a 5,000-digit step in metrics.jsonl made `train --resume` of a downloaded run a ValueError
    traceback; such a line, like a line cut short, is not a step's record and goes."""
    from nanollama4.training.runs import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": ' + "9" * 5000 + '}\n{"step": 2, "val_loss": 2.9}\n'
                    '{"step": 3, "loss": 2.5}\n{"step": 2, "lo')
    truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1, "loss": 3.0}\n{"step": 2, "val_loss": 2.9}\n'
    before = path.stat().st_mtime_ns
    truncate_metrics(path, 2)  # nothing to cut: the file is left as it was
    assert path.stat().st_mtime_ns == before


def test_a_corpus_path_a_run_folder_names_is_shown_with_control_characters_visible(run_copy, capsys):
    """Issue 55: text a run folder chose reached the terminal raw; its train_state.json's corpus path too."""
    import json

    path = run_copy / "step-0000004" / "train_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "data": "/gone\x1b[2J\nforged"}))
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "6", "--quiet"], capsys)
    line = assert_cli_error(rc, err, "train")
    assert f"{run_copy} was trained on /gone\\x1b[2J\\nforged, which no longer exists" in line, line


def test_a_run_trained_on_a_glob_reads_its_text_back(corpus, tmp_path):
    """A recorded corpus that is a glob exists while it matches files (eval, experts and resume read it)."""
    from nanollama4.base.errors import DataError
    from nanollama4.training.runs import corpus_of

    pattern = str(corpus.parent / "*.txt")
    assert corpus_of(tmp_path, {"data": pattern}, None) == pattern
    with pytest.raises(DataError, match="no longer exists"):
        corpus_of(tmp_path, {"data": str(tmp_path / "gone" / "*.py")}, None)
