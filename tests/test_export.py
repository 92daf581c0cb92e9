"""Exports that transformers uses unchanged: the tokenizer loads in AutoTokenizer and encodes as ours does,
generation does not stop at an ordinary token, a model the format cannot describe is refused before
anything is written, and a model trained with bias balancing exports with --drop-bias and a measured cost."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanollama4.base.config import TrainConfig, preset
from nanollama4.base.errors import CheckpointError
from nanollama4.interop.checkpoint import load_run
from nanollama4.interop.hf import export_hf, load_any
from nanollama4.model.moe import MoE
from nanollama4.model.tokenizer import CharTokenizer
from nanollama4.ops import build_model
from nanollama4.training.corpus import find_corpus_files, read_corpus
from nanollama4.training.train import train
from tests.helpers import assert_cli_error, assert_same_greedy_ids, run_cli

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_run(root: Path, corpus: Path, name: str, model: dict | None = None, **tc) -> Path:
    run = root / name
    cfg = TrainConfig(**{**dict(seq_len=32, batch_size=4, eval_batches=2, eval_interval=100, warmup_steps=2,
                                max_steps=4, lr=3e-3), **tc})
    train(preset("tiny", **(model or {})), cfg, run, data=str(corpus), progress=False)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export-runs")
    return {"char": tiny_run(root, corpus, "char"),
            "bpe": tiny_run(root, corpus, "bpe", tokenizer="bpe", bpe_vocab_size=300),
            "bias": tiny_run(root, corpus, "bias", model={"bias_balance_rate": 0.05})}


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_an_export_is_used_by_transformers_unchanged(kind, runs, corpus, tmp_path, capsys):
    """AutoTokenizer encodes every validation line as ours does and reports our end-of-text token as EOS
    (and BOS); AutoModelForCausalLM samples 20 continuations of 64 tokens, none cut short but at that token."""
    out = tmp_path / "hf"
    rc, _, err = run_cli(["export", str(runs[kind]), str(out)], capsys)
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    _, ours, _ = load_run(runs[kind])
    assert ours.eos_id is not None
    assert config["bos_token_id"] == config["eos_token_id"] == generation["eos_token_id"] == ours.eos_id
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.eos_token == theirs.bos_token == "<|end_of_text|>" and theirs.eos_token_id == ours.eos_id
    text = read_corpus(find_corpus_files(str(corpus)))
    lines = [line for line in text[int(len(text) * 0.9):].splitlines() if line]
    assert len(lines) > 10
    for line in lines:
        assert theirs(line, add_special_tokens=False)["input_ids"] == ours.encode(line), line
        assert theirs.decode(ours.encode(line)) == line
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([ours.encode(lines[0][:8])])
    torch.manual_seed(0)
    with torch.no_grad():
        samples = model.generate(prompt.repeat(20, 1), do_sample=True, max_new_tokens=64, min_new_tokens=0,
                                 temperature=1.0, top_k=0, pad_token_id=0)
    ended = [ours.eos_id in row[prompt.shape[1]:].tolist() for row in samples]
    if not all(ended):  # a row that met no end of text ran to its length
        assert samples.shape == (20, prompt.shape[1] + 64)
    _, back = load_any(out)  # and our commands read the exported tokenizer back as the same tokenizer
    assert type(back) is type(ours) and back.encode(lines[1]) == ours.encode(lines[1])
    if kind == "char":
        assert isinstance(back, CharTokenizer) and back.chars == ours.chars


def test_a_model_whose_layers_differ_from_its_config_is_refused_before_writing(tmp_path):
    """8 experts in one layer, 4 in the config: one config.json cannot describe it."""
    model = build_model(preset("tiny"))
    model.blocks[1].ffn = MoE(preset("tiny", n_experts=8))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.ffn\..* is \[8, .*config .*gives it \[4,"):
        export_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_bias_balancing_exports_with_drop_bias_and_says_what_it_costs(runs, tmp_path, capsys, monkeypatch):
    """Refused without --drop-bias; with it, the validation-loss change printed (each of its two full
    validations reporting its progress, token by token, to the bar a terminal shows: issue 72 measured
    over 5 minutes of a 494M-parameter model's with nothing shown), and transformers computes the model
    without the biases."""
    from nanollama4.commands import export as commands

    reported: dict[str, list[tuple[int, int]]] = {}

    def bar(desc: str):
        return lambda done, total: reported.setdefault(desc, []).append((done, total))

    monkeypatch.setattr(commands, "token_bar", bar)
    run = runs["bias"]
    rc, _, err = run_cli(["export", str(run), str(tmp_path / "refused")], capsys)
    assert "--drop-bias" in assert_cli_error(rc, err, "export")
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "hf"
    rc, printed, err = run_cli(["export", str(run), str(out), "--drop-bias"], capsys)
    assert rc == 0, err
    assert sorted(reported) == ["--drop-bias: the loss with the biases", "--drop-bias: the loss without them"]
    for calls in reported.values():
        done = [d for d, _ in calls]
        assert len(calls) > 1 and done == sorted(done) and done[-1] == calls[-1][1] == calls[0][1]
    found = re.search(r"validation loss (\d+\.\d{4}) with .* (\d+\.\d{4}) without them \(([-+]\d+\.\d{4}) "
                      r"nats/token over ([\d,]+) validation tokens\)", printed)
    assert found, printed
    with_bias, without, change = (float(found[i]) for i in (1, 2, 3))
    assert change == pytest.approx(without - with_bias, abs=2e-4) and with_bias != without
    ours, tok, _ = load_run(run)
    assert any(moe.router.expert_bias.abs().max() > 0 for moe in ours.moe_layers())  # there was a bias to drop
    for moe in ours.moe_layers():
        moe.router.expert_bias.zero_()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tok.encode("the cat sat on the mat")])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours.eval()(ids), atol=1e-4, rtol=1e-4)


def test_generate_and_explain_load_a_model_in_bfloat16(runs, tmp_path, capsys):
    """--dtype bfloat16: a reference folder (or a run) held in half the memory, and the commands still answer."""
    out = tmp_path / "hf"
    assert run_cli(["export", str(runs["char"]), str(out)], capsys)[0] == 0
    for path in (out, runs["char"]):
        rc, printed, err = run_cli(["generate", str(path), "--dtype", "bfloat16", "--prompt", "the cat",
                                    "--max-new-tokens", "12", "--greedy"], capsys)
        assert rc == 0 and len(printed.rstrip("\n")) == len("the cat") + 12, err
    rc, printed, err = run_cli(["explain", str(out), "--dtype", "bfloat16", "--prompt", "the cat"], capsys)
    assert rc == 0 and "next token after the prompt" in printed, err
    model, _ = load_any(out, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_generate_takes_a_model_rounded_to_8_bits(runs, corpus, tmp_path, monkeypatch, capsys):
    """--dtype q8_0: generate decodes through the C++ step's 8-bit codes and answers as the rounded float32
    model does (greedy: the same tokens up to a near tie, the step rounding its inputs too); a model whose
    inputs do not cut into blocks of 32 is one line and exit 2."""
    from nanollama4.engine.generation import generate
    from nanollama4.ops import fastdecode

    steps = []
    built = fastdecode.FastStep.__init__

    def spy(self, *args, **kwargs):
        built(self, *args, **kwargs)
        steps.append(type(self._step).__name__)

    monkeypatch.setattr(fastdecode.FastStep, "__init__", spy)
    rc, printed, err = run_cli(["generate", str(runs["char"]), "--dtype", "q8_0", "--prompt", "the cat",
                                "--max-new-tokens", "12", "--greedy"], capsys)
    assert rc == 0 and steps and set(steps) == {"DecodeStepQ8"}, (err, steps)
    model, tok, _ = load_run(runs["char"])
    fastdecode.round_to_q8_0(model)
    del model.q8_0  # the same rounded parameters, decoded with float products
    plain = "the cat" + generate(model.eval(), tok, "the cat", max_new_tokens=12, temperature=0.0)
    prompt = tok.encode("the cat")
    # (the step's rounded inputs moved the top token's log-probability by up to 0.14 over 255 tokens of
    # `make demo`'s run: two greedy texts may part only at a near tie that close)
    assert_same_greedy_ids(model, prompt, tok.encode(printed.rstrip("\n"))[len(prompt):],
                           tok.encode(plain)[len(prompt):], tol=0.3)
    odd = tiny_run(tmp_path, corpus, "odd", model={"expert_dim": 48})
    rc, _, err = run_cli(["generate", str(odd), "--dtype", "q8_0", "--prompt", "the"], capsys)
    assert rc == 2 and "input widths that are a multiple of 32" in err and "Traceback" not in err, err


def test_a_run_trained_before_the_end_of_text_token_loads_trains_on_and_exports_as_before(corpus, tmp_path,
                                                                                          monkeypatch, capsys):
    """A tokenizer.json without "end_of_text" (as every run before Interop III saved): no EOS anywhere."""
    import nanollama4.training.runsetup as runsetup

    real = CharTokenizer.from_text
    monkeypatch.setattr(runsetup.CharTokenizer, "from_text",
                        staticmethod(lambda text, replace=None, end_of_text=False: real(text, replace)))
    old = tiny_run(tmp_path, corpus, "old")
    monkeypatch.undo()
    saved = json.loads((old / "last" / "tokenizer.json").read_text())
    assert "end_of_text" not in saved
    model, tok, _ = load_run(old)
    assert tok.eos_id is None and model.cfg.vocab_size == len(tok.chars)
    rc, out, err = run_cli(["export", str(old), str(tmp_path / "hf")], capsys)
    assert rc == 0, err
    assert "no end-of-text token" in out and not (tmp_path / "hf" / "tokenizer_config.json").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] is None
    rc, _, err = run_cli(["train", "--resume", str(old), "--max-steps", "6"], capsys)
    assert rc == 0, err
    _, tok, _ = load_run(old, prefer="last")
    assert tok.eos_id is None


def test_only_a_dead_exports_own_temporary_folder_is_removed(runs, tmp_path, capsys):
    """A transformers export killed while writing left its hidden .NAME.tmp-PID-* folder (as big as the model)
    for good; the next export into the folder removes it, and leaves what is not certainly one: a live
    export's (its pid alive, or its lock held), a link, a folder holding anything an export does not write,
    a GGUF export's file, a name no export gives."""
    import fcntl

    from tests.test_llamacpp import dead_pid

    folder = tmp_path / "exports"
    folder.mkdir()
    gone = dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    files = {"config.json": b"{}", "model.safetensors": b"x" * 1000}
    try:
        keep = {f".a.tmp-{live.pid}-abcdefgh": files,  # its writer is running
                f".b.tmp-{gone}-abcdefgh": files,  # locked below: a writer elsewhere
                f".c.tmp-{gone}-abcdefgh": {**files, "notes.txt": b"mine"},  # not only what an export writes
                f".d.tmp-{gone}-abcdefg": files}  # not a name an export gives
        for name, content in keep.items():
            (folder / name).mkdir()
            for f, data in content.items():
                (folder / name / f).write_bytes(data)
        (tmp_path / "elsewhere").mkdir()
        (folder / f".e.tmp-{gone}-abcdefgh").symlink_to(tmp_path / "elsewhere")
        (folder / f".f.gguf.tmp-{gone}-abcdefgh").write_bytes(b"GGUF")  # a GGUF export's: not a folder
        for name in (f".g.tmp-{gone}-abcdefgh", f".h.tmp-{gone}-abcdefgh"):  # removed
            (folder / name).mkdir()
        for f, data in files.items():
            (folder / f".h.tmp-{gone}-abcdefgh" / f).write_bytes(data)
        held = os.open(folder / f".b.tmp-{gone}-abcdefgh", os.O_RDONLY)
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
            rc, stdout, err = run_cli(["export", str(runs["char"]), str(folder / "new")], capsys)
        finally:
            os.close(held)
        assert rc == 0, err
    finally:
        live.kill()
        live.wait()
    assert stdout.count("note: removed") == 2 and f".h.tmp-{gone}-abcdefgh (0.0 MiB)" in stdout, stdout
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted([*keep, f".e.tmp-{gone}-abcdefgh", f".f.gguf.tmp-{gone}-abcdefgh", "new"])
    assert all((folder / name / f).read_bytes() == data for name, c in keep.items() for f, data in c.items())
    assert (folder / f".e.tmp-{gone}-abcdefgh").is_symlink() and (tmp_path / "elsewhere").is_dir()


@pytest.mark.parametrize("fields", [dict(expert_dim=16, shared_expert_dim=64), dict(shared_expert=False)])
def test_params_says_before_training_what_an_export_pads_and_by_how_much(fields, tmp_path, capsys):
    """Issue 72: a 3.1M-parameter run of 32 narrow experts became 10.2M in transformers, and nothing said so
    until the export. `params` says it for the settings, with the count the export then holds."""
    sets = [x for k, v in fields.items() for x in ("--set", f"{k}={str(v).lower()}")]
    rc, printed, err = run_cli(["params", "--preset", "tiny", *sets], capsys)
    assert rc == 0, err
    found = re.search(r"a transformers export of this model holds ([\d.]+K) parameters against its ([\d.]+K)", printed)
    assert found, printed
    model = build_model(preset("tiny", **fields))
    tok = CharTokenizer([chr(32 + i) for i in range(model.cfg.vocab_size)])
    export_hf(model, tmp_path / "hf", tok.save_hf)
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        held = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    from nanollama4.model.memory import format_count

    assert found[1] == format_count(held) and found[2] == format_count(sum(p.numel() for p in model.parameters()))
    rc, printed, _ = run_cli(["params", "--preset", "tiny"], capsys)
    assert "transformers export" not in printed  # one width for both: nothing padded
