"""LoRA (`--set lora_rank=R` with --init-from): adapters on the attention projections, the dense and shared
SwiGLUs and every routed expert (batched like the experts), the model frozen; saved apart, resumed exactly,
merged for generate, eval and export, and merged logits equal to the adapted model's."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nanollama4.base.config import preset
from nanollama4.base.errors import CheckpointError, ConfigError
from nanollama4.interop.checkpoint import load_model, load_run, resolve_checkpoint
from nanollama4.model import lora
from nanollama4.ops import build_model
from nanollama4.training.evaluation import autocast
from tests.helpers import TINY, assert_cli_error, run_cli, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

LORA = ["--set", "seq_len=32", "--set", "batch_size=4", "--set", "eval_batches=2", "--set", "threads=1",
        "--set", "warmup_steps=2", "--set", "lr=1e-2", "--no-plots", "--quiet"]


def mixed_model() -> torch.nn.Module:
    """Dense and MoE layers (moe_every=2), a shared expert: every kind of matrix LoRA adapts."""
    torch.manual_seed(0)
    return build_model(preset("tiny", moe_every=2, vocab_size=40))


def randomise(model: torch.nn.Module) -> None:
    """Give every adapter a non-zero B, as training would."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, lora.LowRank):
                m.lora_B.normal_(std=0.05)


def test_adapters_start_as_the_model_and_reach_every_matrix_kind():
    model = mixed_model().eval()
    x = torch.randint(0, 40, (2, 24))
    before = model(x)
    lora.attach(model, rank=4, alpha=8)
    assert torch.equal(model(x), before)  # B starts at zero: the adapted model is the model
    cfg = model.cfg
    kinds = {type(m).__name__.removeprefix("Parametrized") for _, m, _, _ in lora.targets(model)}
    assert {"Linear", "FastLinear", "FastExperts"} <= kinds
    shapes = lora.adapter_shapes(model)
    moe = next(p for p in shapes if p.endswith("experts.gate_up.lora_A")).rsplit(".", 1)[0]
    E, D, H, r = cfg.n_experts, cfg.d_model, cfg.expert_dim, 4
    assert shapes[f"{moe}.lora_A"] == (E, D, r) and shapes[f"{moe}.lora_B"] == (E, r, 2 * H)
    assert shapes["blocks.0.attn.q_proj.weight.lora_A"] == (r, D)
    assert shapes["blocks.0.attn.q_proj.weight.lora_B"] == (cfg.n_heads * cfg.head_dim, r)
    expected = sum(r * (a + b) * (e or 1) for e, a, b in _matrix_sides(model))
    assert lora.trainable(model) == expected
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def _matrix_sides(model) -> list[tuple[int, int, int]]:
    """(experts or 0, rows, cols) of every adapted matrix, from the model's own shapes."""
    out = []
    for _, m, name, in_first in lora.targets(model):
        w = m.parametrizations[name].original
        out.append((w.shape[0] if in_first else 0, *w.shape[-2:]))
    return out


def test_each_experts_change_is_its_own_low_rank_product():
    model = mixed_model()
    lora.attach(model, rank=3, alpha=6)
    randomise(model)
    experts = next(m for m in model.modules() if lora.parametrize.is_parametrized(m, "gate_up"))
    adapter = experts.parametrizations.gate_up[0]
    original = experts.parametrizations.gate_up.original
    for e in range(experts.n_experts):
        assert torch.allclose(experts.gate_up[e], original[e] + 2.0 * adapter.lora_A[e] @ adapter.lora_B[e],
                              atol=1e-6)


@pytest.mark.parametrize("bf16", [False, True])
def test_only_the_adapters_train(bf16):
    model = mixed_model().train()
    lora.attach(model, rank=2)
    randomise(model)
    x = torch.randint(0, 40, (2, 32))
    with autocast(torch.device("cpu"), bf16):
        model.loss(x, x).total.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None for n, g in grads.items() if "lora_" not in n)
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_" in n)


def test_merged_logits_equal_the_adapted_models(tmp_path):
    model = mixed_model().eval()
    lora.attach(model, rank=4, alpha=4)
    randomise(model)
    x = torch.randint(0, 40, (3, 40))
    adapted = model(x)
    lora.save_adapters(model, tmp_path / "a.safetensors")
    fresh = mixed_model().eval()  # the same frozen model, seeded alike
    assert not torch.allclose(fresh(x), adapted, atol=1e-3)  # the adapters change something
    lora.load_adapters(fresh, tmp_path / "a.safetensors", merged=True)
    assert not lora.is_attached(fresh) and type(fresh.blocks[0].attn.q_proj) is torch.nn.Linear
    assert torch.allclose(fresh(x), adapted, atol=1e-5, rtol=0)
    lora.merge(model)
    assert torch.allclose(model(x), adapted, atol=1e-5, rtol=0)


def test_bad_settings_and_files_are_one_clear_error(tmp_path):
    model = mixed_model()
    with pytest.raises(ConfigError, match="exceeds the smallest adapted matrix"):
        lora.attach(model, rank=10_000)
    lora.attach(model, rank=2)
    with pytest.raises(ConfigError, match="carries adapters already"):
        lora.attach(model, rank=2)
    lora.save_adapters(model, tmp_path / "a.safetensors")
    other = build_model(preset("tiny", vocab_size=40))  # no dense layers: other names
    with pytest.raises(CheckpointError, match="does not fit this model"):
        lora.load_adapters(other, tmp_path / "a.safetensors")
    tensors = load_file(tmp_path / "a.safetensors")
    save_file(tensors, tmp_path / "no-meta.safetensors")
    with pytest.raises(CheckpointError, match="not an adapters file"):
        lora.load_adapters(mixed_model(), tmp_path / "no-meta.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(CheckpointError, match="not an adapters file"):
        lora.load_adapters(mixed_model(), tmp_path / "junk.safetensors")


def test_adapters_that_are_not_floating_point_or_not_a_file_are_refused(tmp_path):
    """Issue 55: int32 adapters loaded without a word (copied into the float factors); judged from the header,
    before a tensor is read. A FIFO in their place is refused instead of blocking the read."""
    import os

    model = mixed_model()
    lora.attach(model, rank=2)
    lora.save_adapters(model, tmp_path / "a.safetensors")
    with safe_open(tmp_path / "a.safetensors", framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(tmp_path / "a.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, tmp_path / "int.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=rf"int.safetensors holds a tensor that is not floating point, "
                                              rf"{re.escape(name)} \(I32\); adapters are float factors") as e:
        lora.load_adapters(mixed_model(), tmp_path / "int.safetensors")
    assert "\n" not in str(e.value)
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(CheckpointError, match="is not a regular file but a FIFO"):
        lora.load_adapters(mixed_model(), tmp_path / "fifo.safetensors")


# ---------------------------------------------------------------------------------------------- through the CLI
@pytest.fixture(scope="module")
def lora_run(tiny_run, tmp_path_factory):
    """A rank-4 LoRA run of 4 steps from `tiny_run` on other text, and the text."""
    home = tmp_path_factory.mktemp("lora")
    text = write_corpus(home / "new.txt", n_lines=200, seed=7)
    out = home / "tuned"
    from nanollama4.cli import main
    assert main(["train", "--init-from", str(tiny_run), "--data", str(text), "--out", str(out), "--max-steps", "4",
                 "--set", "lora_rank=4", "--set", "eval_interval=2", "--set", "decay_steps=6", *LORA]) == 0
    return out, text


def test_a_lora_run_saves_adapters_apart_and_keeps_the_model_frozen(lora_run, tiny_run):
    out, _ = lora_run
    ckpt = resolve_checkpoint(out, prefer="last")
    assert (ckpt / "adapters.safetensors").is_file()
    base, frozen = load_file(resolve_checkpoint(tiny_run) / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert base.keys() == frozen.keys() and all(torch.equal(base[k], frozen[k]) for k in base)
    with safe_open(ckpt / "adapters.safetensors", framework="pt") as f:
        assert f.metadata()["lora_rank"] == "4"
        assert any(f.get_tensor(k).abs().sum() > 0 for k in f.keys() if k.endswith("lora_B"))  # it trained
    saved = json.loads((ckpt / "train_config.json").read_text())
    assert saved["lora_rank"] == 4 and saved["init_from"] == str(tiny_run)
    first = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][0]
    from tests.test_finetune import first_loss
    assert first["lm_loss"] == pytest.approx(first_loss(tiny_run, lora_run[1], 1337, out.parent / "c"), rel=1e-5)


def test_commands_merge_the_adapters(lora_run, tmp_path, capsys):
    out, _ = lora_run
    ckpt = resolve_checkpoint(out, prefer="last")
    adapted = load_model(ckpt, merged=False).eval()
    assert lora.is_attached(adapted)
    merged, tokenizer, _ = load_run(out, prefer="last")
    assert not lora.is_attached(merged)
    x = torch.tensor([tokenizer.encode("the cat sat on the mat.")])
    with torch.no_grad():
        want = adapted(x)
        assert torch.allclose(merged.eval()(x), want, atol=1e-5, rtol=0)
    assert run_cli(["export", str(out), str(tmp_path / "hf"), "--checkpoint", "last"], capsys)[0] == 0
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, want, atol=1e-4, rtol=0)
    rc, printed, err = run_cli(["generate", str(out), "--prompt", "the", "--max-new-tokens", "8"], capsys)
    assert rc == 0, err


def test_a_lora_run_resumes_exactly(lora_run, tiny_run, tmp_path, capsys):
    out, text = lora_run
    whole = tmp_path / "whole"  # the same run straight through to step 6
    assert run_cli(["train", "--init-from", str(tiny_run), "--data", str(text), "--out", str(whole), "--max-steps",
                    "6", "--set", "lora_rank=4", "--set", "eval_interval=2", "--set", "decay_steps=6", *LORA],
                   capsys)[0] == 0
    part = tmp_path / "part"
    shutil.copytree(out, part, symlinks=True)
    rc, _, err = run_cli(["train", "--resume", str(part), "--max-steps", "6", "--quiet"], capsys)
    assert rc == 0, err

    def lines(run):
        return [{k: v for k, v in json.loads(x).items() if k in ("step", "loss", "val_loss")}
                for x in (run / "metrics.jsonl").read_text().splitlines()]

    assert lines(part) == lines(whole) and lines(part)[-1]["step"] == 6
    adapters = [load_file(resolve_checkpoint(r) / "adapters.safetensors") for r in (part, whole)]
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    rc, _, err = run_cli(["train", "--resume", str(part), "--max-steps", "8", "--set", "lora_rank=8", "--quiet"],
                         capsys)
    assert "lora_rank=4, which a resume keeps" in assert_cli_error(rc, err, "train")


@pytest.mark.parametrize("extra, message", [
    ([], "adapts trained weights: give them with --init-from"),
    (["--set", "optimizer=muon"], "lora_rank trains with optimizer=adamw"),
    (["--set", "parallel=fsdp"], "parallel=ddp and expert_parallel=1"),
])
def test_lora_settings_that_cannot_work_are_one_line(extra, message, tiny_run, tmp_path, capsys):
    init = [] if not extra else ["--init-from", str(tiny_run)]
    rc, _, err = run_cli(["train", *TINY, *init, "--set", "lora_rank=4", *extra, "--out", str(tmp_path / "o"),
                          "--max-steps", "1"], capsys)
    assert message in assert_cli_error(rc, err, "train")
    assert not (tmp_path / "o").exists()


def test_lora_rank_larger_than_a_matrix_is_refused_before_training(tiny_run, tmp_path, capsys):
    rc, _, err = run_cli(["train", "--init-from", str(tiny_run), "--set", "lora_rank=100000", *LORA,
                          "--out", str(tmp_path / "o"), "--max-steps", "1"], capsys)
    assert "exceeds the smallest adapted matrix" in assert_cli_error(rc, err, "train")


def test_init_from_a_lora_run_starts_from_its_merged_weights(lora_run, tmp_path, capsys):
    out, text = lora_run
    nxt = tmp_path / "next"
    rc, _, err = run_cli(["train", "--init-from", str(out), "--data", str(text), "--out", str(nxt),
                          "--max-steps", "1", *LORA], capsys)
    assert rc == 0, err
    assert not (resolve_checkpoint(nxt) / "adapters.safetensors").exists()
    assert Path(resolve_checkpoint(nxt) / "model.safetensors").is_file()
