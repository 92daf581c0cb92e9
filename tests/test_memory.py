"""Parameter and KV-cache arithmetic: known published numbers and hand-computed small cases."""

import pytest

from nanollama4.base.config import ModelConfig, preset
from nanollama4.model.memory import format_bytes, format_kv_table, format_params_table, kv_cache, param_counts


def test_seed_example_kv_cache_numbers():
    r = kv_cache(preset("seed-example"), 8192, "float16")
    assert r.values_per_token_per_layer == 2048
    assert r.mha_values_per_token_per_layer == 8192
    assert r.gqa_saving == 4.0
    assert r.values_per_token == 65536
    assert r.bytes_per_value == 2
    assert r.bytes_per_token == 131072
    assert r.bytes_for_sequence == 2**30


def test_seed_example_kv_table_text():
    table = format_kv_table(kv_cache(preset("seed-example"), 8192))
    for text in ("2,048", "8,192", "4x fewer", "65,536", "128 KiB", "1 GiB"):
        assert text in table, (text, table)


@pytest.mark.parametrize("dtype,size", [("float32", 4), ("fp32", 4), ("bf16", 2), ("bfloat16", 2), ("fp8", 1),
                                        ("int8", 1)])
def test_dtype_sizes(dtype, size):
    assert kv_cache(preset("seed-example"), 1, dtype).bytes_per_token == 65536 * size


def test_bad_dtype_and_seq_len_raise():
    cfg = preset("seed-example")
    with pytest.raises(ValueError, match="float16"):
        kv_cache(cfg, 10, "float64")
    for bad in (0, -5, 2.5, "8"):
        with pytest.raises(ValueError, match="seq_len"):
            kv_cache(cfg, bad)


def test_chunked_layers_cache_chunk_minus_one_positions():
    cfg = ModelConfig(attention_chunk_size=4, nope_interval=2, n_layers=4)
    # layers 0 and 2 use RoPE (chunked: 3 positions), layers 1 and 3 are NoPE (all 100)
    r = kv_cache(cfg, 100, "float32")
    per_layer = 2 * cfg.n_kv_heads * cfg.head_dim
    assert r.bytes_for_sequence == (3 + 3 + 100 + 100) * per_layer * 4
    # shorter than a chunk: every layer caches the whole sequence
    assert kv_cache(cfg, 2, "float32").bytes_for_sequence == 4 * 2 * per_layer * 4


def test_llama4_scout_counts():
    p = param_counts(preset("llama4-scout"))
    assert p.total == pytest.approx(108e9, rel=0.03)
    assert p.active == pytest.approx(17e9, rel=0.03)


def test_llama4_maverick_counts():
    p = param_counts(preset("llama4-maverick"))
    assert p.total == pytest.approx(400e9, rel=0.03)
    assert p.active == pytest.approx(17e9, rel=0.03)
    assert p.dense_ffn > 0 and p.experts > 0  # interleaved: half the layers dense, half MoE


def test_tied_embeddings_remove_lm_head():
    untied = param_counts(preset("tiny"))
    tied = param_counts(preset("tiny", tie_embeddings=True))
    assert untied.lm_head == untied.embedding > 0
    assert tied.lm_head == 0
    assert untied.total - tied.total == untied.embedding


def test_active_scales_routed_experts_only():
    p = param_counts(preset("tiny"))  # 4 experts, top-2
    assert p.total - p.active == p.experts // 2
    rows = {name: (total, active) for name, total, active in p.as_rows()}
    assert rows["experts"] == (p.experts, p.experts // 2)
    assert rows["shared_expert"][0] == rows["shared_expert"][1] > 0
    assert sum(t for t, _ in rows.values()) == p.total
    assert sum(a for _, a in rows.values()) == p.active


def test_learned_noise_counted():
    cfg = preset("tiny", router="softmax", **{"softmax.noise": "learned"})
    assert param_counts(cfg).noise == cfg.n_experts * cfg.d_model * cfg.n_layers
    assert param_counts(preset("tiny", router="softmax", **{"softmax.noise": "fixed"})).noise == 0


def test_params_table_text():
    table = format_params_table(preset("llama4-scout"))
    assert "107.8B" in table and "17.2B" in table
    assert "experts" in table and "attention" in table


def test_format_bytes():
    assert format_bytes(131072) == "128 KiB"
    assert format_bytes(2**30) == "1 GiB"
    assert format_bytes(1536 * 1024) == "1.50 MiB"
    assert format_bytes(100) == "100 B"


def test_matches_model_parameter_count():
    # Depends on nanollama4.model.transformer (class Transformer(cfg)).
    from nanollama4.model.transformer import Transformer

    cfg = preset("tiny")
    assert param_counts(cfg).total == sum(p.numel() for p in Transformer(cfg).parameters())


def test_the_check_yourself_commands_print_the_numbers(capsys):
    """kv-cache --compare, params --compare and rope-check: the seed's three questions, answered."""
    from nanollama4.cli import main

    assert main(["kv-cache", "--preset", "seed-example", "--compare"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:7]}
    assert rows["8,192"] == ["4", "GiB", "1", "GiB", "1023.88", "MiB"]  # MHA, GQA (4x fewer), + chunks
    assert rows["1,048,576"] == ["512", "GiB", "128", "GiB", "1023.88", "MiB"]  # chunks bound it
    assert main(["params", "--preset", "llama4-maverick", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "400.7B" in out and out.count("17.2B") == 3 and "23.3x" in out
    assert main(["rope-check", "--preset", "seed-example"]) == 0
    lines = capsys.readouterr().out.splitlines()[2:5]
    for line in lines:
        m, n, _, *scores, spread = line.split()
        scores = [float(v) for v in scores]
        assert max(scores[:3]) - min(scores[:3]) < 1e-4  # shifts of 0, 1 and 1000 positions
        assert float(spread) < 1e-2
    assert float(lines[2].split()[-1]) < 1e-5  # m = n: the very same rotation on both sides


def test_training_memory_adds_up_and_its_largest_batch_fits():
    """The step check's arithmetic (`train.check_step_fits`): the state counts weights, gradients and the
    optimizer's moments; the largest batch it names fits and one more does not."""
    from nanollama4.model.memory import training_memory

    cfg = preset("shakespeare-char")
    total = param_counts(cfg).total
    adamw = training_memory(cfg, 32, 256, "adamw")
    muon = training_memory(cfg, 32, 256, "muon")
    assert adamw.state == 4 * 4 * total  # weights, gradients and two moments, float32
    assert 3 * 4 * total < muon.state < adamw.state  # Muon keeps one momentum for the hidden matrices
    assert training_memory(cfg, 32, 256, bf16=True).per_sequence < adamw.per_sequence
    assert training_memory(cfg, 32, 128).per_sequence * 2 == adamw.per_sequence  # linear in the length
    free = 3 * 2**30
    fits = adamw.largest_batch(free)
    assert training_memory(cfg, fits, 256).total <= free < training_memory(cfg, fits + 1, 256).total
    assert adamw.largest_batch(adamw.state - 1) == 0


def test_a_shared_expert_of_its_own_width_keeps_top2_at_half_width_equal_in_active_size(capsys):
    """With one width for both, top-2 of half-width experts had half a shared expert too: fewer active
    parameters than the top-1 it was meant to match. shared_expert_dim keeps the shared expert whole; the
    counts match the built model, `params --compare`'s dense twin has the FFN of that active width, and
    `active_size_note` names the arms whose active sizes differ."""
    from nanollama4.cli import main
    from nanollama4.model.memory import active_size_note, format_layout, format_params_compare
    from nanollama4.model.transformer import Transformer

    top1 = preset("tiny", experts_per_token=1, expert_dim=64)
    half = preset("tiny", experts_per_token=2, expert_dim=32)
    whole = preset("tiny", experts_per_token=2, expert_dim=32, shared_expert_dim=64)
    assert param_counts(half).active < param_counts(top1).active == param_counts(whole).active
    assert param_counts(whole).shared_expert == param_counts(top1).shared_expert == 3 * 64 * 64 * 4
    assert param_counts(whole).total == sum(p.numel() for p in Transformer(whole).parameters())
    assert "top-2 + shared of width 64" in format_layout(whole) and "+ shared of" not in format_layout(half)
    assert "dense, FFN 128 (same active size)" in format_params_compare(whole)
    assert main(["params", "--preset", "tiny", "--set", "expert_dim=32", "--set", "shared_expert_dim=64",
                 "--compare"]) == 0
    assert "top-2 + shared of width 64" in capsys.readouterr().out
    assert active_size_note([("top1", param_counts(top1).active), ("whole", param_counts(whole).active)]) is None
    note = active_size_note([("top1", param_counts(top1).active), ("half", param_counts(half).active)])
    assert note is not None and "top1" in note and "half" in note and "differ" in note
    assert "1,001" in active_size_note([("a", 1000), ("b", 1001)])  # alike once rounded: whole numbers


def test_a_router_kind_with_weights_of_its_own_is_counted_without_building_the_model():
    """A kind declares its extra weights (`Router.extra_parameters`); `param_counts` asks it, and the count
    equals the built model's, for the softmax router's learned noise and for a kind defined here."""
    import torch
    from torch import nn

    from nanollama4.base.parts import ROUTERS
    from nanollama4.model.router import SigmoidRouter
    from nanollama4.model.transformer import Transformer

    class Gated(SigmoidRouter, name="gated-test", about="a test's: a sigmoid router with a gain per expert"):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.gain = nn.Parameter(torch.ones(cfg.n_experts))

        @classmethod
        def extra_parameters(cls, cfg):
            return cfg.n_experts

    try:
        learned = preset("tiny", router="softmax", **{"softmax.noise": "learned"})
        for cfg in (learned, preset("tiny", router="gated-test")):
            assert param_counts(cfg).total == sum(p.numel() for p in Transformer(cfg).parameters())
        assert param_counts(preset("tiny", router="gated-test")).noise == 4 * preset("tiny").n_layers
    finally:
        ROUTERS.remove("gated-test")


@pytest.mark.parametrize("chunk,first_layer", [(8, (7, True)), (33, (32, True)), (41, (40, False)),
                                               (48, (40, False)), (None, (40, False))])
def test_every_cache_keeps_the_slots_the_config_states(chunk, first_layer):
    """How many keys a layer keeps is stated once (`ModelConfig.cache_slots`): a chunked layer a ring of
    chunk - 1 where that is shorter than the context, any other one slot a position. Generation's cache, the
    engine's slot cache and the memory arithmetic all keep that many."""
    import torch

    from nanollama4.engine.cache import SlotCache
    from nanollama4.model.attention import KVCache

    cfg = ModelConfig(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=40,
                      attention_chunk_size=chunk, nope_interval=2, n_experts=0, ffn_dim=32)
    context = 40
    want = [cfg.cache_slots(i, context) for i in range(cfg.n_layers)]
    assert want[1] == (context, False)  # a NoPE layer attends to the whole past
    assert want[0] == first_layer  # a RoPE layer: a ring of chunk - 1 where that is shorter than the context
    generation = KVCache(cfg, 1, context)
    engine = SlotCache(cfg, 1, torch.float32, torch.device("cpu"), context)
    assert [(layer.k.shape[1], layer.window) for layer in generation.layers] == want
    assert [(layer.k.shape[1], layer.window) for layer in engine.layers] == want
    per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * 2  # keys and values in float16
    assert kv_cache(cfg, context, "float16").bytes_for_sequence == per_slot * sum(slots for slots, _ in want)
