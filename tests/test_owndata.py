"""Your own data: a folder of any files (a folder of Python sources trains), a glob, the validation share
as a setting, and `eval RUN --data FILE` scoring the whole of a text the run was not trained on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import TINY, run_cli, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_a_folder_of_python_files_trains_and_val_fraction_is_used(tmp_path, capsys):
    src = Path(__file__).resolve().parents[1] / "src" / "nanollama4"
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    for i, f in enumerate(sorted(src.glob("*.py"))[:6]):
        (code / ("pkg" if i % 2 else "") / f.name).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    (code / ".git").mkdir()
    (code / ".git" / "index").write_bytes(b"\x00\xff binary")  # hidden: skipped, so no UTF-8 error
    out = tmp_path / "run"
    rc, printed, err = run_cli(["train", *TINY, "--data", str(code), "--out", str(out), "--max-steps", "2",
                                "--set", "val_fraction=0.25"], capsys)
    assert rc == 0, err
    found = re.search(r"([\d,]+) training and ([\d,]+) validation tokens \(the last 25%\)", printed)
    assert found, printed
    n_train, n_val = (int(found[i].replace(",", "")) for i in (1, 2))
    text_chars = sum(len(f.read_text(encoding="utf-8")) for f in code.rglob("*.py"))
    assert n_train + n_val == text_chars and n_val == int(text_chars * 0.25)  # char tokens: one per character
    assert (out / "last").exists()


def test_a_glob_picks_the_files(tmp_path, capsys):
    books = tmp_path / "books"
    books.mkdir()
    write_corpus(books / "a.txt", n_lines=200)
    (books / "notes.bin").write_bytes(b"\xff\xfe not text")
    out = tmp_path / "run"
    rc, _, err = run_cli(["train", *TINY, "--data", str(books / "*.txt"), "--out", str(out), "--max-steps", "1"],
                         capsys)
    assert rc == 0, err


def test_eval_of_another_text_scores_all_of_it(tiny_run, tmp_path, capsys):
    held = write_corpus(tmp_path / "held_out.txt", n_lines=40, seed=11)  # other lines, the same characters
    rc, printed, err = run_cli(["eval", str(tiny_run), "--data", str(held)], capsys)
    assert rc == 0, err
    found = re.search(r"loss on .*held_out\.txt: \d+\.\d{4} nats/token over all ([\d,]+) of its tokens", printed)
    assert found, printed
    assert int(found[1].replace(",", "")) == len(held.read_text(encoding="utf-8"))
    assert not (tiny_run / "evaluation.json").exists() or "held_out" not in (tiny_run / "evaluation.json").read_text()


def test_val_data_is_the_validation_text_and_all_of_data_trains(corpus, tmp_path, capsys):
    held = write_corpus(tmp_path / "held.txt", n_lines=60, seed=5)
    out = tmp_path / "run"
    rc, printed, err = run_cli(["train", *TINY, "--data", str(corpus), "--val-data", str(held), "--out", str(out),
                                "--max-steps", "2"], capsys)
    assert rc == 0, err
    found = re.search(r"([\d,]+) training and ([\d,]+) validation tokens \(all of (.*held\.txt)\)", printed)
    assert found, printed
    assert int(found[1].replace(",", "")) == len(corpus.read_text(encoding="utf-8"))
    assert int(found[2].replace(",", "")) == len(held.read_text(encoding="utf-8"))
    rc, printed, err = run_cli(["eval", str(out)], capsys)  # the run's own validation: the held-out text, whole
    assert rc == 0 and f"over {len(held.read_text(encoding='utf-8')):,} tokens" in printed, err + printed
    strange = tmp_path / "strange.txt"
    strange.write_text("ΩΩΩ\n" * 50, encoding="utf-8")
    rc, _, err = run_cli(["train", *TINY, "--data", str(corpus), "--val-data", str(strange), "--out",
                          str(tmp_path / "refused"), "--max-steps", "1"], capsys)
    assert "validation text in the training text's characters" in err and rc == 2
