"""Fine-tuning: a new run from the weights of a run or a transformers folder (--init-from) starts where that
model is (its first loss is the source model's own on that batch), brings its tokenizer, and refuses text the
tokenizer cannot encode; --resume refuses another text and points to --init-from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanollama4.interop.checkpoint import load_run
from nanollama4.interop.hf import load_any
from nanollama4.training.corpus import find_corpus_files
from nanollama4.training.data import TokenDataset
from tests.helpers import TINY, assert_cli_error, run_cli, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def first_loss(source, data: Path, seed: int, cache: Path) -> float:
    """The source model's loss on the first batch a new run with this seed draws (micro-batch 0 of step 1)."""
    model, tokenizer = load_any(source)
    dataset = TokenDataset.build(find_corpus_files(str(data)), tokenizer, cache)
    starts = dataset.draw_starts("train", 4, 32, torch.Generator().manual_seed(seed))
    x, y = dataset.batch_at("train", starts, 32)
    with torch.no_grad():
        return model.train().loss(x, y).lm.item()


def logged(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"lm_loss"' in x]


@pytest.mark.parametrize("source", ["run", "transformers"])
def test_init_from_starts_at_the_source_models_loss(source, tiny_run, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(cache))
    new_text = write_corpus(tmp_path / "new.txt", n_lines=200, seed=7)  # other text, the same characters
    origin = tiny_run
    if source == "transformers":
        origin = tmp_path / "hf"
        assert run_cli(["export", str(tiny_run), str(origin)], capsys)[0] == 0
    out = tmp_path / "tuned"
    rc, printed, err = run_cli(["train", "--init-from", str(origin), "--data", str(new_text), "--out", str(out),
                                "--max-steps", "3", "--set", "seq_len=32", "--set", "batch_size=4",
                                "--set", "eval_batches=2", "--set", "threads=1", "--quiet"], capsys)
    assert rc == 0, err
    assert f"weights and tokenizer from {origin}" in printed
    steps = logged(out)
    assert steps[0]["lm_loss"] == pytest.approx(first_loss(origin, new_text, 1337, cache), rel=1e-5)
    assert steps[-1]["step"] == 3
    tuned, tokenizer, saved = load_run(out, prefer="last")
    base, base_tokenizer, _ = load_run(tiny_run)
    assert tokenizer.encode("the cat") == base_tokenizer.encode("the cat") and tuned.cfg == base.cfg
    assert saved["init_from"] == str(origin)
    assert 'init_from = "' in (out / "config.toml").read_text()


def test_init_from_refuses_text_its_tokenizer_cannot_encode(tiny_run, tmp_path, capsys):
    other = tmp_path / "greek.txt"
    other.write_text("αβγ δεζ\n" * 200, encoding="utf-8")
    rc, _, err = run_cli(["train", "--init-from", str(tiny_run), "--data", str(other), "--out",
                          str(tmp_path / "out"), "--max-steps", "1", "--quiet"], capsys)
    line = assert_cli_error(rc, err, "train")
    assert "cannot encode" in line and f"the tokenizer comes with the weights of {tiny_run}" in line
    assert not (tmp_path / "out").exists()


def test_resume_refuses_another_text_and_points_to_init_from(run_copy, tmp_path, capsys):
    other = write_corpus(tmp_path / "other.txt", n_lines=300, seed=3)
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--data", str(other), "--max-steps", "8",
                          *TINY[-1:]], capsys)
    line = assert_cli_error(rc, err, "train")
    assert "is not the text" in line and f"--init-from {run_copy}" in line
