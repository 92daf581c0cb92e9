"""Your own data: a folder of any files (a folder of Python sources trains), a glob, the validation share
as a setting, and `eval RUN --data FILE` scoring the whole of a text the run was not trained on."""

from __future__ import annotations

import json
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
    files = len(list(code.rglob("*.py")))  # each followed by the end-of-text token
    assert n_train + n_val == text_chars + files and n_val == int((text_chars + files) * 0.25)
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


BOUND_SCRIPT = """
import resource, sys
import torch
from nanollama4.base.config import TrainConfig, preset
from nanollama4.training.train import train
torch.set_num_threads(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
train(preset("tiny"), TrainConfig(seq_len=32, batch_size=4, eval_batches=1, eval_interval=2, max_steps=2,
      warmup_steps=1), sys.argv[2], data=sys.argv[1], progress=False)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(before, after)
"""


def test_a_corpus_larger_than_a_memory_bound_tokenises_and_trains_within_it(corpus, tmp_path):
    """A 64 MiB corpus, tokenised and trained on, grows the process's peak memory by at most a quarter of its
    size more than a 1 MiB corpus does (the same training otherwise; measured: about a sixth, the token file's
    pages): read whole, at ~48 bytes per character, it would take ~3 GiB more."""
    import os
    import subprocess
    import sys

    line = corpus.read_text(encoding="utf-8")

    def peak_growth(name: str, size: int) -> tuple[int, int]:
        text = tmp_path / f"{name}.txt"
        with open(text, "w", encoding="utf-8") as f:
            while f.tell() < size:
                f.write(line)
        env = {**os.environ, "NANOLLAMA4_CACHE": str(tmp_path / name), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-c", BOUND_SCRIPT, str(text), str(tmp_path / f"run-{name}")],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        before, after = map(int, proc.stdout.split()[-2:])
        header = next((tmp_path / name).glob("tokens-*.json"))
        assert json.loads(header.read_text())["n_tokens"] == text.stat().st_size  # one id per (ASCII) character
        return after - before, text.stat().st_size

    small, _ = peak_growth("small", 2**20)
    big, size = peak_growth("big", 64 * 2**20)
    assert big - small < size / 4, f"64 MiB grew the peak by {(big - small) / 2**20:.0f} MiB more than 1 MiB did"


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_the_corpus_encodes_in_pieces_to_the_ids_of_the_whole_text(kind, monkeypatch):
    """Pieces cut only where a BPE cannot tell (a lone line end between a visible character and a letter or
    digit), encoded in batches, give the whole text's ids; blank lines, trailing spaces and runs of newlines
    (which a byte-level pre-tokenizer splits differently at the end of a text) never end a piece."""
    import random

    from nanollama4.model.tokenizer import BPETokenizer, CharTokenizer
    from nanollama4.training import corpus

    rng = random.Random(5)
    endings = ["\n", "\n\n", "\n\n\n", " \n", "\t\n", ".\n", "\n \n"]
    text = "".join(rng.choice(["To be", "or not", "42 ways", "x", "Ay me", "¿qué?"]) + rng.choice(endings)
                   for _ in range(4000))
    tokenizer = CharTokenizer.from_text(text) if kind == "char" else BPETokenizer.train(text, 300)
    monkeypatch.setattr(corpus, "ENCODE_PIECE", 64)
    monkeypatch.setattr(corpus, "ENCODE_GROUP", 5)
    monkeypatch.setattr(corpus, "READ_BYTES", 64)
    read = [text[i:i + 97] for i in range(0, len(text), 97)]  # as iter_corpus hands the text over
    pieces = list(corpus.encoded_pieces(read, tokenizer))
    assert "".join(p for p, _ in pieces) == text and len(pieces) > 20
    assert [i for _, ids in pieces for i in ids] == tokenizer.encode(text)
    assert all(len(p) >= 64 and p.endswith("\n") and not p[-2].isspace() for p, _ in pieces[:-1])
