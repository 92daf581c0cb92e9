"""runtext.py, the one reader of a run's text: `eval`, `experts`, `compare --experts` and `train --resume`
read a run's corpus and validation text back only where it is the text the run recorded (its sha256), and
never read a file only because a run folder names it."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from .helpers import TINY, assert_cli_error, run_cli, snapshot, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")
SECRET = "zqxjv zqxjv.\n" * 200  # in the tiny run's alphabet, and in none of its text: printed, it shows


def _edit(run: Path, name: str, **fields: object) -> None:
    """Set (or, for None, remove) `fields` in every checkpoint's `name` JSON file of `run`."""
    for path in run.glob(f"step-*/{name}"):
        record = json.loads(path.read_text())
        record.update(fields)
        path.write_text(json.dumps({k: v for k, v in record.items() if v is not None}))


def _own_copy(run: Path, corpus: Path, tmp_path: Path) -> Path:
    """The corpus `run` records moved to a private copy of `corpus` (the same text: its sha256 holds)."""
    (tmp_path / "text").mkdir()
    text = Path(shutil.copy(corpus, tmp_path / "text" / "corpus.txt"))
    _edit(run, "train_state.json", data=str(text))
    return text


def test_a_corpus_changed_since_training_is_refused_by_every_reader(run_copy, corpus, tmp_path, capsys):
    """Issue 69: after text was appended to the corpus, `eval` reported a loss over other tokens with rc 0 and
    kept it in evaluation.json. Every reader now refuses the changed text in one line naming it and the fix;
    a text passed with --data that is not the run's is scored whole and said to be another text."""
    text = _own_copy(run_copy, corpus, tmp_path)
    rc, out, err = run_cli(["eval", str(run_copy)], capsys)
    assert rc == 0, err
    loss = re.search(r"full validation loss: (\S+)", out)[1]
    recorded = snapshot(run_copy)

    with open(text, "a", encoding="utf-8") as f:
        f.write("the cat sat on the mat.\n" * 40)
    rc, out, err = run_cli(["eval", str(run_copy)], capsys)
    line = assert_cli_error(rc, err, "eval")
    assert f"{text} is not the corpus {run_copy} was trained on: it has changed since" in line
    assert "pass --data TEXT" in line and out == ""
    rc, out, err = run_cli(["experts", str(run_copy), "--quiet"], capsys)
    assert "it has changed since" in assert_cli_error(rc, err, "experts") and out == ""
    rc, out, err = run_cli(["compare", str(run_copy), "--out", str(tmp_path / "cmp"), "--experts", "300"], capsys)
    assert rc == 0 and f"- run: {text} is not the corpus" in out, err
    rc, out, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "6", *TINY[-1:]], capsys)
    assert "it has changed since" in assert_cli_error(rc, err, "train")
    assert snapshot(run_copy) == recorded  # evaluation.json and the checkpoints as they were

    rc, out, err = run_cli(["eval", str(run_copy), "--data", str(text)], capsys)  # named: another text, whole
    assert rc == 0 and f"loss on {text}: " in out and "not the text the run was trained on" in out, err
    assert snapshot(run_copy) == recorded

    text.write_text(corpus.read_text(encoding="utf-8"), encoding="utf-8")  # put back: read again, same loss
    rc, out, err = run_cli(["eval", str(run_copy)], capsys)
    assert rc == 0 and f"full validation loss: {loss} " in out, err


@pytest.mark.parametrize("case", ["other-hash", "no-hash", "not-utf8", "val-data"])
def test_a_run_folder_names_no_file_to_read(case, run_copy, tmp_path, token_cache, capsys):
    """Issue 69: a crafted train_state.json whose "data" names a local file made `experts` print contexts from
    it. A path a run folder names is read only where the folder records the sha256 of its text and the text
    has it; nothing of the file reaches the output or the token cache, and no command reads it."""
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET) if case != "not-utf8" else secret.write_bytes(b"zqxjv \xff\xfe secret\n" * 50)
    if case == "val-data":
        _edit(run_copy, "train_config.json", val_data=str(secret))
        _edit(run_copy, "train_state.json", val_sha256=hashlib.sha256(b"what the author claims").hexdigest())
    else:
        _edit(run_copy, "train_state.json", data=str(secret), corpus_sha256=None if case == "no-hash" else
              hashlib.sha256(b"what the author claims").hexdigest())
    cached = sorted(token_cache.glob("*")) if token_cache.exists() else []
    expected = {"other-hash": "is not the corpus", "no-hash": "without the sha256 of that text, so it is not read",
                "not-utf8": "cannot be read as the corpus", "val-data": "is not the validation text"}[case]
    before = snapshot(run_copy)
    for argv in (["experts", str(run_copy), "--quiet"], ["eval", str(run_copy)],
                 ["train", "--resume", str(run_copy), "--max-steps", "6", *TINY[-1:]]):
        rc, out, err = run_cli(argv, capsys)
        line = assert_cli_error(rc, err, argv[0])
        assert expected in line and str(secret) in line, line
        assert "zqx" not in out + err and "0xff" not in line
    assert snapshot(run_copy) == before
    assert (sorted(token_cache.glob("*")) if token_cache.exists() else []) == cached  # never tokenized


def test_a_validation_text_is_recorded_and_read_back_only_as_it_was(corpus, tmp_path, capsys):
    """A run with --val-data records that text's sha256 (val_sha256) beside its corpus's, and its readers
    check it as they check the corpus: appended to, it is refused; named with --data, it is scored whole. A
    run saved before the hash was recorded has its validation text refused, and --data names it."""
    held = write_corpus(tmp_path / "held.txt", n_lines=60, seed=5)
    run = tmp_path / "run"
    rc, _, err = run_cli(["train", *TINY, "--data", str(corpus), "--val-data", str(held), "--out", str(run),
                          "--max-steps", "2"], capsys)
    assert rc == 0, err
    state = json.loads((run / "step-0000002" / "train_state.json").read_text())
    assert state["val_sha256"] == hashlib.sha256(held.read_bytes()).hexdigest()
    n_held = len(held.read_text(encoding="utf-8"))
    rc, out, err = run_cli(["eval", str(run)], capsys)
    assert rc == 0 and f"over {n_held:,} tokens" in out, err

    text = held.read_text(encoding="utf-8")
    held.write_text(text + "a new line.\n", encoding="utf-8")
    rc, out, err = run_cli(["eval", str(run)], capsys)
    assert f"{held} is not the validation text {run} was trained on" in assert_cli_error(rc, err, "eval")
    held.write_text(text, encoding="utf-8")

    _edit(run, "train_state.json", val_sha256=None)  # as a run saved before val_sha256 was
    rc, out, err = run_cli(["eval", str(run)], capsys)
    assert "names its validation text" in assert_cli_error(rc, err, "eval")
    rc, out, err = run_cli(["eval", str(run), "--data", str(held)], capsys)
    assert rc == 0 and f"over all {n_held:,} of its tokens" in out, err
