"""Our model gives the reference implementation's logits (transformers' Llama4ForCausalLM), both ways.

transformers -> ours through load_hf, ours -> transformers through export_hf; float32, max abs <= 1e-4,
random weights with non-trivial norm gains (the reference init of gains = 1 would hide gain bugs).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import nanollama4
from nanollama4.interop.hf import CheckpointError
from tests.helpers import randomize_

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=16, num_local_experts=8, intermediate_size=48, intermediate_size_mlp=96,
            max_position_embeddings=64, pad_token_id=None, attention_chunk_size=4, attn_temperature_tuning=True,
            floor_scale=2, attn_scale=0.5, use_qk_norm=True, no_rope_layer_interval=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "moe_all_top2_chunk4": dict(interleave_moe_layer_step=1),
    "moe_every2": dict(interleave_moe_layer_step=2),
    "nope2_top1": dict(no_rope_layer_interval=2, num_experts_per_tok=1),
    "llama3_rope": dict(rope_parameters=LLAMA3),
    "no_qk_norm_tied": dict(use_qk_norm=False, tie_word_embeddings=True),
    "no_chunk_no_temp": dict(attention_chunk_size=None, attn_temperature_tuning=False, interleave_moe_layer_step=2,
                             num_experts_per_tok=1),
}




def reference_model(**overrides):
    cfg = transformers.Llama4TextConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(cfg).eval()
    randomize_(model)
    return model


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def assert_loads_as(path, ref, length: int) -> None:
    """The checkpoint at `path`, loaded by load_hf, gives the reference model's logits on random ids."""
    ids = torch.randint(0, 256, (1, length))
    with torch.no_grad():
        got = nanollama4.load_hf(path).eval()(ids)
    assert (got - reference_logits(ref, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_to_ours(case, tmp_path):
    ref = reference_model(**CASES[case])
    ref.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(7))
    ours = nanollama4.load_hf(tmp_path).eval()
    with torch.no_grad():
        got = ours(ids)
    want = reference_logits(ref, ids)
    assert want.abs().max() > 1.0  # the logits are not trivially small
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_ours_to_transformers(case, tmp_path):
    cfg = nanollama4.interop.hf.config_from_hf({**TINY, **CASES[case]})
    ours = nanollama4.build_model(cfg).eval()
    randomize_(ours, seed=99)
    nanollama4.export_hf(ours, tmp_path)
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got = ours(ids)
    want = reference_logits(ref.eval(), ids)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("shared", [dict(shared_expert_dim=96), dict(shared_expert_dim=24),
                                    dict(shared_expert=False)], ids=["wider", "narrower", "none"])
def test_a_shared_expert_of_another_width_or_none_exports_exactly(shared, tmp_path):
    """The reference has one width (intermediate_size) for the routed and the shared experts, and an always-on
    shared expert; export used to refuse shared_expert=false. The narrower is padded with zeros (gate and up
    rows, down columns: the same SwiGLU) and a missing shared expert is written as zeros: transformers
    gives our logits, and loaded back the model gives them too."""
    cfg = nanollama4.interop.hf.config_from_hf({**TINY, "interleave_moe_layer_step": 2}).replace(**shared)
    ours = nanollama4.build_model(cfg).eval()
    randomize_(ours, seed=98)
    nanollama4.export_hf(ours, tmp_path)
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert ref.config.intermediate_size == max(48, shared.get("shared_expert_dim", 0))
    note = nanollama4.interop.hf.padding_note(cfg)  # what `nanollama4 export` prints after writing
    assert note is not None and "zero" in note and f"({ref.config.intermediate_size})" in note
    assert nanollama4.interop.hf.padding_note(cfg.replace(shared_expert=True, shared_expert_dim=0)) is None
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got = ours(ids)
        back = nanollama4.load_hf(tmp_path).eval()(ids)
    want = reference_logits(ref.eval(), ids)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max().item() <= 1e-4 and (back - want).abs().max().item() <= 1e-4


def test_multimodal_prefix_and_legacy_rope_keys(tmp_path):
    """The multimodal checkpoints nest the text model under `language_model.`; old configs use rope_theta."""
    import json

    from safetensors.torch import load_file, save_file

    ref = reference_model(rope_parameters=LLAMA3)
    ref.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({f"language_model.{k}": v for k, v in weights.items()}, tmp_path / "model.safetensors")
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    rope = hf_cfg.pop("rope_parameters")
    hf_cfg["rope_theta"] = rope.pop("rope_theta")
    hf_cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    for key in ("no_rope_layers", "moe_layers", "layer_types"):
        hf_cfg.pop(key)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": hf_cfg}))
    assert_loads_as(tmp_path, ref, length=12)


def test_sharded_checkpoint(tmp_path):
    ref = reference_model()
    ref.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert_loads_as(tmp_path, ref, length=9)


def test_inconsistent_or_unsupported_checkpoints_fail_clearly(tmp_path):
    import json

    ref = reference_model()
    ref.save_pretrained(tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    bad_layout = {**hf_cfg, "moe_layers": [0, 2]}
    (tmp_path / "config.json").write_text(json.dumps(bad_layout))
    with pytest.raises(CheckpointError, match="moe_layers"):
        nanollama4.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf_cfg, "hidden_size": 32}))
    with pytest.raises(CheckpointError, match="shape"):
        nanollama4.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="corrupt"):
        nanollama4.load_hf(tmp_path)
    with pytest.raises(CheckpointError, match="router"):
        nanollama4.export_hf(nanollama4.build_model(nanollama4.preset("tiny", router="softmax")), tmp_path / "x")


# ---------------------------------------------------------------------------------------------- crafted folders
@pytest.fixture
def sharded(tmp_path):
    """A sharded reference checkpoint, and the JSON of its index."""
    import json

    ref = reference_model()
    ref.save_pretrained(tmp_path / "ckpt", max_shard_size="200KB")
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    return tmp_path / "ckpt", index, json.loads(index.read_text())


@pytest.mark.parametrize("shard", ["../elsewhere/x.safetensors", "/etc/passwd", "sub/x.safetensors", "link"])
def test_an_index_may_only_name_files_in_its_own_folder(shard, sharded, tmp_path):
    import json

    folder, index, data = sharded
    (tmp_path / "elsewhere").mkdir()
    first = sorted(set(data["weight_map"].values()))[0]
    (tmp_path / "elsewhere" / "x.safetensors").write_bytes((folder / first).read_bytes())
    (folder / "link").symlink_to(tmp_path / "elsewhere" / "x.safetensors")
    name = next(iter(data["weight_map"]))
    index.write_text(json.dumps({**data, "weight_map": {**data["weight_map"], name: shard}}))
    with pytest.raises(CheckpointError, match="a shard is a file name in the checkpoint folder|lies outside"):
        nanollama4.load_hf(folder)


def test_a_fifo_shard_is_refused_instead_of_hanging(sharded):
    import os

    folder, _, data = sharded
    first = sorted(set(data["weight_map"].values()))[0]
    (folder / first).unlink()
    os.mkfifo(folder / first)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        nanollama4.load_hf(folder)


@pytest.mark.parametrize(("edit", "message"), [
    ("weight_map_list", "weight_map must map each tensor name to a shard file name"),
    ("index_list", "holds a JSON list, not the dict expected"),
    ("text_config_5", "text_config must be a JSON object"),
    ("layers_huge", "num_hidden_layers|n_layers"),
])
def test_malformed_reference_json_is_one_error(edit, message, sharded):
    import json

    folder, index, data = sharded
    config = json.loads((folder / "config.json").read_text())
    if edit == "weight_map_list":
        index.write_text(json.dumps({**data, "weight_map": list(data["weight_map"])}))
    elif edit == "index_list":
        index.write_text("[1, 2]")
    elif edit == "text_config_5":
        (folder / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": 5}))
    else:
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**8}))
    with pytest.raises(CheckpointError, match=message):
        nanollama4.load_hf(folder)


def test_export_command_writes_a_checkpoint_transformers_loads_and_our_commands_take(tiny_run, tmp_path, capsys):
    """`nanollama4 export RUN DIR`: the run's best checkpoint as a reference directory with its tokenizer."""
    from nanollama4.interop.checkpoint import load_run
    from nanollama4.interop.hf import load_any
    from tests.helpers import run_cli

    out = tmp_path / "exported"
    rc, stdout, err = run_cli(["export", str(tiny_run), str(out)], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    ours, tok, _ = load_run(tiny_run)
    theirs = transformers.Llama4ForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tok.encode("the cat sat on the mat")])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=1e-4, rtol=1e-4)
    model, tokenizer = load_any(out)  # what generate, explain and serve load
    assert tokenizer.encode("the cat") == tok.encode("the cat")
    rc, stdout, err = run_cli(["explain", str(out), "--prompt", "the cat"], capsys)
    assert rc == 0 and "next token after the prompt" in stdout, err
    rc, _, err = run_cli(["export", str(tiny_run), str(out)], capsys)  # never over a folder with files in it
    assert rc == 2 and "not an empty folder" in err


@pytest.mark.parametrize("empty_folder_first", [False, True])
def test_a_failed_export_leaves_nothing_that_a_retry_refuses(tiny_run, tmp_path, capsys, monkeypatch,
                                                           empty_folder_first):
    """A full disk (or a kill) mid-export used to leave a half-written folder that the retry refused as
    "not an empty folder"."""
    import errno
    import os

    import nanollama4.interop.hf as hf
    from tests.helpers import assert_cli_error, run_cli

    real = hf.save_file

    def written_then_full(tensors, path, **kw):
        real(tensors, path, **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / "exported"
    if empty_folder_first:
        out.mkdir()
    monkeypatch.setattr(hf, "save_file", written_then_full)
    rc, _, err = run_cli(["export", str(tiny_run), str(out)], capsys)
    assert "no space left on the device" in assert_cli_error(rc, err, "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["exported"] if empty_folder_first else [])
    assert not out.exists() or not any(out.iterdir())
    monkeypatch.setattr(hf, "save_file", real)
    rc, _, err = run_cli(["export", str(tiny_run), str(out)], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]


def test_exporting_into_a_symlink_says_it_is_a_link_and_writes_nothing(tiny_run, tmp_path, capsys):
    """A link to an empty folder used to be refused as "not an empty folder", which it is."""
    from tests.helpers import assert_cli_error, run_cli

    empty = tmp_path / "empty"
    empty.mkdir()
    link = tmp_path / "link"
    link.symlink_to(empty)
    rc, _, err = run_cli(["export", str(tiny_run), str(link)], capsys)
    line = assert_cli_error(rc, err, "export")
    assert f"{link} is a symlink (to {empty}); export into a new or empty folder that is not a link" in line, line
    assert not any(empty.iterdir()) and link.is_symlink()


def test_load_hf_fills_the_model_in_the_dtype_asked(tmp_path):
    """Interop II: the checkpoint's tensors go into the meta-built model shard by shard in the dtype asked,
    nothing left on the meta device (the balancing buffers made at zero), logits as the float32 model's."""
    ours = nanollama4.build_model(nanollama4.preset("tiny")).eval()
    nanollama4.export_hf(ours, tmp_path / "hf")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for dtype, tol in ((torch.float32, 0.0), (torch.bfloat16, 0.05)):
        loaded = nanollama4.load_hf(tmp_path / "hf", dtype=dtype).eval()
        tensors = list(loaded.named_parameters()) + list(loaded.named_buffers())
        assert not [name for name, t in tensors if t.is_meta]
        assert {t.dtype for t in loaded.parameters()} == {dtype}
        assert all(not moe.router.expert_bias.any() for moe in loaded.moe_layers())
        with torch.no_grad():
            assert (loaded(ids).float() - ours(ids)).abs().max().item() <= tol


def test_non_finite_weights_are_refused_naming_the_tensor_and_the_file(tiny_run, tmp_path, capsys):
    """Issue 55: NaN weights in a transformers folder loaded, and --init-from then said "lower lr"; they are
    refused as checkpoint.py refuses them in our own checkpoints."""
    from safetensors.torch import load_file, save_file

    from tests.helpers import assert_cli_error, run_cli

    assert run_cli(["export", str(tiny_run), str(tmp_path / "hf")], capsys)[0] == 0
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{weights} holds non-finite values \(in {name}\); the weights are "
                                              "damaged"):
        nanollama4.load_hf(tmp_path / "hf")
    rc, _, err = run_cli(["generate", str(tmp_path / "hf"), "--prompt", "the", "--max-new-tokens", "1"], capsys)
    assert f"holds non-finite values (in {name})" in assert_cli_error(rc, err, "generate")
