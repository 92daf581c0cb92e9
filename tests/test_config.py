"""ModelConfig validation, presets, (de)serialisation, override parsing and the derived layer layout."""

from __future__ import annotations

import json

import pytest

from nanollama4.base.config import PRESETS, ModelConfig, parse_overrides, preset

INVALID = {
    "heads_not_divisible": ("n_heads", dict(n_heads=6, n_kv_heads=4)),
    "odd_head_dim": ("head_dim", dict(head_dim=15)),
    "k_above_n": ("experts_per_token", dict(n_experts=4, experts_per_token=5)),
    "k_zero": ("experts_per_token", dict(n_experts=4, experts_per_token=0)),
    "d_model_zero": ("d_model", dict(d_model=0)),
    "n_layers_negative": ("n_layers", dict(n_layers=-1)),
    "vocab_zero": ("vocab_size", dict(vocab_size=0)),
    "ffn_zero": ("ffn_dim", dict(ffn_dim=0)),
    "expert_dim_zero": ("expert_dim", dict(expert_dim=0)),
    "shared_expert_dim_negative": ("shared_expert_dim", dict(shared_expert_dim=-1)),
    "d_model_float": ("d_model", dict(d_model=64.0)),
    "chunk_zero": ("attention_chunk_size", dict(attention_chunk_size=0)),
    "chunk_negative": ("attention_chunk_size", dict(attention_chunk_size=-8)),
    "bad_router": ("router", dict(router="topk")),
    "bad_noise": ("softmax.noise", dict(router="softmax", settings={"softmax": {"noise": "gumbel"}})),
    "noise_not_a_setting": ("softmax.nois", dict(router="softmax", settings={"softmax": {"nois": "fixed"}})),
    "no_such_kind": ("softmaxx", dict(settings={"softmaxx": {"noise": "fixed"}})),
    "capacity_zero": ("capacity_factor", dict(capacity_factor=0.0)),
    "capacity_negative": ("capacity_factor", dict(capacity_factor=-1.25)),
    "low_above_high": ("rope_low_freq_factor", dict(rope_scaling=8.0, rope_low_freq_factor=4.0,
                                                    rope_high_freq_factor=1.0)),
    "rope_scaling_zero": ("rope_scaling", dict(rope_scaling=0.0)),
    "nope_negative": ("nope_interval", dict(nope_interval=-1)),
    "n_experts_negative": ("n_experts", dict(n_experts=-2)),
    "theta_zero": ("rope_theta", dict(rope_theta=0.0)),
    "attn_scale_negative": ("attn_scale", dict(attn_scale=-0.1)),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_config_raises_one_line_error_naming_the_field(case):
    field, kwargs = INVALID[case]
    with pytest.raises(ValueError) as info:
        ModelConfig(**kwargs)
    message = str(info.value)
    assert field in message, message
    assert "\n" not in message and message.strip() == message and message


@pytest.mark.parametrize("case", sorted(INVALID))
def test_replace_and_from_dict_validate_too(case):
    field, kwargs = INVALID[case]
    with pytest.raises(ValueError, match=field):
        ModelConfig().replace(**kwargs)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict({**ModelConfig().to_dict(), **kwargs})


def test_valid_edge_cases_construct():
    ModelConfig(head_dim=15, nope_interval=1)  # every layer is NoPE: no pair rotation, odd widths are fine
    ModelConfig(n_experts=0, experts_per_token=7)  # dense: k is unused
    ModelConfig(rope_scaling=16.0, rope_low_freq_factor=1.0, rope_high_freq_factor=1.0)  # low == high (Scout)
    ModelConfig(attention_chunk_size=None, capacity_factor=None, nope_interval=0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_construct(name):
    cfg = preset(name)
    assert isinstance(cfg, ModelConfig)
    assert cfg.n_heads % cfg.n_kv_heads == 0
    assert preset(name, d_model=cfg.d_model) == cfg


def test_preset_overrides_and_unknown_preset():
    assert preset("tiny", n_experts=8).n_experts == 8
    with pytest.raises(ValueError, match="tiny"):  # lists the valid names
        preset("tinyy")
    with pytest.raises(ValueError, match="n_expert"):
        preset("tiny", n_expert=8)


def test_from_dict_rejects_unknown_keys():
    data = {**ModelConfig().to_dict(), "d_modle": 64}
    with pytest.raises(ValueError, match="d_modle") as info:
        ModelConfig.from_dict(data)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="n_head"):
        ModelConfig.from_dict({"n_head": 4})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_to_dict_from_dict_round_trip(name):
    cfg = preset(name)
    data = cfg.to_dict()
    assert set(data) == set(ModelConfig.__dataclass_fields__) - {"settings"} | {"softmax.noise", "softmax.noise_std",
                                                                                "softmax.over"}
    assert ModelConfig.from_dict(data) == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(data))) == cfg  # survives a JSON file
    changed = cfg.replace(rope_scaling=8.0, capacity_factor=1.25, attention_chunk_size=None)
    assert ModelConfig.from_dict(json.loads(json.dumps(changed.to_dict()))) == changed != cfg


def test_parse_overrides_types_values():
    out = parse_overrides(["n_experts=8", "attention_chunk_size=none", "use_qk_norm=false", "rope_theta=1e4",
                           "router=softmax", "capacity_factor=1.5", "rope_scaling=None", "tie_embeddings=yes",
                           " d_model = 96 "])
    assert out == dict(n_experts=8, attention_chunk_size=None, use_qk_norm=False, rope_theta=10000.0,
                       router="softmax", capacity_factor=1.5, rope_scaling=None, tie_embeddings=True, d_model=96)
    assert type(out["n_experts"]) is int and type(out["rope_theta"]) is float and out["use_qk_norm"] is False
    assert parse_overrides(["attention_chunk_size=16"]) == {"attention_chunk_size": 16}
    assert parse_overrides([]) == {}
    # the typed values make a valid config
    assert preset("tiny", **out).n_experts == 8


def test_parse_overrides_rejects_unknown_key_listing_valid_ones():
    with pytest.raises(ValueError) as info:
        parse_overrides(["n_expert=8"])
    message = str(info.value)
    assert "n_expert" in message and "\n" not in message
    for valid in ("n_experts", "d_model", "rope_theta", "attention_chunk_size"):
        assert valid in message


def test_a_key_runs_used_to_take_is_refused_naming_its_name_now(capsys):
    """`--set router_noise=...` (a key runs used to take; old runs' files still load with it) said only
    "unknown key" and listed some eighty others."""
    from tests.helpers import assert_cli_error, run_cli

    rc, _, err = run_cli(["config", "--set", "router_noise=learned"], capsys)
    assert assert_cli_error(rc, err, "config") == (
        "nanollama4 config: error: unknown key 'router_noise': it is softmax.noise now (the softmax router's own "
        "setting); --set softmax.noise=learned")
    rc, _, err = run_cli(["train", "--set", "muon_lr=0.01", "--max-steps", "1"], capsys)
    assert assert_cli_error(rc, err, "train").endswith("'muon_lr': it is muon.lr now (the muon optimizer's own "
                                                       "setting); --set muon.lr=0.01")
    with pytest.raises(ValueError, match=r"^unknown key 'router_noise_std': it is softmax\.noise_std now"):
        parse_overrides(["router_noise_std=0.5"])


@pytest.mark.parametrize("pair,field", [
    ("n_experts=eight", "n_experts"), ("rope_theta=big", "rope_theta"), ("use_qk_norm=maybe", "use_qk_norm"),
    ("d_model=64.5", "d_model"), ("n_layers=none", "n_layers"), ("attention_chunk_size=x", "attention_chunk_size"),
])
def test_parse_overrides_rejects_wrong_type(pair, field):
    with pytest.raises(ValueError) as info:
        parse_overrides([pair])
    message = str(info.value)
    assert field in message and "\n" not in message


def test_parse_overrides_rejects_missing_equals():
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["n_experts"])


def test_layer_layout():
    cfg = ModelConfig(n_layers=8, nope_interval=4, attention_chunk_size=16)
    assert [i for i in range(8) if not cfg.uses_rope(i)] == [3, 7]
    assert [cfg.chunk_size(i) for i in range(8)] == [16, 16, 16, None, 16, 16, 16, None]
    assert all(ModelConfig(n_layers=8, nope_interval=0).uses_rope(i) for i in range(8))
    assert not any(ModelConfig(n_layers=8, nope_interval=1, head_dim=15).uses_rope(i) for i in range(8))

    assert [i for i in range(4) if ModelConfig(n_layers=4, moe_every=2).is_moe(i)] == [1, 3]
    assert [i for i in range(4) if ModelConfig(n_layers=4, moe_every=1).is_moe(i)] == [0, 1, 2, 3]
    assert not any(ModelConfig(n_layers=4, n_experts=0).is_moe(i) for i in range(4))
    assert ModelConfig(n_heads=8, n_kv_heads=2).n_rep == 4


def test_scout_and_maverick_layouts():
    scout, maverick = preset("llama4-scout"), preset("llama4-maverick")
    assert [i for i in range(48) if not scout.uses_rope(i)] == list(range(3, 48, 4))
    assert all(scout.is_moe(i) for i in range(48))
    assert [i for i in range(48) if maverick.is_moe(i)] == list(range(1, 48, 2))


def test_the_demo_is_a_miniature_of_llama4_attention():
    """The demo's RoPE layers attend in chunks shorter than its context, and its NoPE layer's temperature
    varies within the context (with Llama 4's floor of 8,192 it was 1.0 at every one of 256 positions)."""
    import torch

    from nanollama4.model.attention import temperature_scale

    cfg = preset("shakespeare-char")
    chunks = [cfg.chunk_size(i) for i in range(cfg.n_layers) if cfg.uses_rope(i)]
    assert chunks and all(c is not None and c < cfg.max_seq_len for c in chunks)
    assert any(not cfg.uses_rope(i) for i in range(cfg.n_layers)) and cfg.attn_temperature_tuning
    temperature = temperature_scale(torch.arange(cfg.max_seq_len), cfg.floor_scale, cfg.attn_scale)
    assert len(set(temperature.tolist())) >= 4 and temperature.max() > 1.1


def test_bf16_takes_true_false_or_auto():
    from nanollama4.base.config import TrainConfig
    from nanollama4.base.errors import ConfigError

    assert parse_overrides(["bf16=auto", "lr=1e-3"], TrainConfig) == {"bf16": "auto", "lr": 1e-3}
    assert parse_overrides(["bf16=off"], TrainConfig) == {"bf16": False}
    assert TrainConfig(bf16="auto").bf16 == "auto"
    for bad in ("yes", 1, 2.0, None):
        with pytest.raises(ConfigError, match=r"bf16 .* must be true, false or 'auto'"):
            TrainConfig(bf16=bad)
    with pytest.raises(ConfigError, match="bf16='sometimes': expected true, false or auto"):
        parse_overrides(["bf16=sometimes"], TrainConfig)
