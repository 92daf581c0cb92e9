"""The fast products live beside the model (nanollama4.ops) and never bypass its modules."""

from __future__ import annotations

import time
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanollama4.ops.experts as experts_mod
from nanollama4 import ops
from nanollama4.base.config import preset
from nanollama4.base.errors import ConfigError
from nanollama4.engine.generation import iter_tokens
from nanollama4.model.attention import Attention, attention_mask
from nanollama4.model.moe import MoE
from nanollama4.model.rope import rope_angles, rope_frequencies
from nanollama4.model.transformer import Transformer
from nanollama4.ops import build_model, install, kernels
from nanollama4.ops.attention import scores_attention
from nanollama4.ops.experts import PRODUCTS, chosen_product
from nanollama4.ops.linear import FastLinear


@pytest.fixture
def model() -> Transformer:
    """MoE and dense layers (moe_every 2), a shared expert; d_model 64 so that fp32 training takes our kernel."""
    torch.manual_seed(0)
    return build_model(preset("tiny", moe_every=2))


def _hook_every_linear(model: nn.Module) -> tuple[Counter, dict[str, nn.Linear]]:
    calls: Counter = Counter()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name, m in linears.items():
        m.register_forward_hook(lambda mod, inputs, output, name=name: calls.update([name]))
    return calls, linears


@pytest.mark.skipif(not kernels.available(), reason="needs the compiled CPU kernel (a C++ compiler)")
def test_hooks_on_every_linear_fire_in_training_eval_and_decoding(model, monkeypatch):
    """The SwiGLU used to multiply by its projections' weights directly on our kernel, so hooks on them
    (explain mode, LoRA, quantization) silently missed every fp32 CPU training and eval call. The kernel is
    forced here: auto takes it only with AVX-512."""
    monkeypatch.setenv("NANOLLAMA4_CPU_KERNELS", "force")
    calls, linears = _hook_every_linear(model)
    assert sum(isinstance(m, FastLinear) for m in linears.values()) == 3 * 4  # 2 dense FFNs + 2 shared experts
    ids = torch.randint(0, model.cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))

    with mock.patch.object(kernels.Linear, "apply", wraps=kernels.Linear.apply) as kernel:
        model.train()
        model.loss(ids, ids).total.backward()
    assert kernel.called  # the premise: this is the path that used to bypass the modules
    assert set(calls) == set(linears) and set(calls.values()) == {1}, calls

    calls.clear()
    with torch.no_grad(), mock.patch.object(kernels.Linear, "apply", wraps=kernels.Linear.apply) as kernel:
        model.eval()(ids)
    assert kernel.called
    assert set(calls) == set(linears) and set(calls.values()) == {1}, calls

    calls.clear()
    list(iter_tokens(model, [[1, 2, 3, 4, 5]], 2, temperature=0))  # a prefill, then one decode step
    assert set(calls) == set(linears) and set(calls.values()) == {2}, calls


def test_generation_runs_the_lm_head_on_the_last_position_only(model):
    """A 1,000-token prompt with a 200k vocabulary would otherwise build (1, 1000, 200k) float32 logits."""
    model = build_model(preset("tiny", max_seq_len=256)).eval()
    rows_seen = []
    model.lm_head.register_forward_hook(lambda mod, inputs, output: rows_seen.append(inputs[0].shape[1]))
    list(iter_tokens(model, [list(range(1, 60)) * 3], 5, temperature=0))
    assert rows_seen == [1] * 5
    ids = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, last_only=True), model(ids)[:, -1:], atol=1e-6, rtol=1e-6)


def test_an_unknown_dispatch_name_lists_the_valid_ones(model):
    moe = model.moe_layers()[0]
    with pytest.raises(ConfigError) as info:
        moe.experts.dispatch = "fastest"  # refused when set, so decoding (which sorts nothing) cannot hide it
    assert str(info.value) == "unknown expert dispatch 'fastest'; valid: auto, loop, grouped, kernel, padded, bucketed"
    with pytest.raises(ConfigError, match="unknown expert dispatch 'fastest'"):
        chosen_product("fastest", torch.zeros(3, 64), 64, 1)
    assert chosen_product("auto", torch.zeros(3, 64), 64, 1) == ("kernel" if kernels.fp32_pays() else "grouped")


def test_auto_in_bf16_on_the_cpu_takes_the_kernel_where_it_can(monkeypatch):
    """bf16 CPU with AVX512_BF16: the kernel, for every row count, at widths it takes; elsewhere the rules
    of the CPUs without it (next test)."""
    from nanollama4.ops.experts import auto_product

    monkeypatch.setattr(kernels, "bf16_available", lambda: True)
    monkeypatch.setattr(experts_mod, "faster_product", lambda names, *shape: f"timed{shape}")
    assert auto_product(torch.zeros(4096, 256, dtype=torch.bfloat16), 384, 8) == "timed(256, 384, 8, 4096)"
    assert auto_product(torch.zeros(2047, 256, dtype=torch.bfloat16), 384, 8) == "kernel"  # under 256 per expert
    assert auto_product(torch.zeros(0, 256, dtype=torch.bfloat16), 384, 128, rows=768) == "kernel"
    assert auto_product(torch.zeros(0, 6, dtype=torch.bfloat16), 5, 8, rows=4096) == "bucketed"  # widths it cannot take
    assert auto_product(torch.zeros(0, 48, dtype=torch.bfloat16), 64, 8, rows=4096) == "bucketed"


@pytest.mark.skipif(not kernels.bf16_available(), reason="needs the kernel's bf16 products (AVX512_BF16)")
def test_the_faster_product_is_timed_once_per_shape(monkeypatch):
    """Between the kernel and the bucketed loop, the one that ran faster here, asked once per rounded shape."""
    calls = []
    real = dict(experts_mod.PRODUCTS)

    def slow(x, *rest):
        calls.append(x.shape[0])
        time.sleep(0.02)
        return real["kernel"](x, *rest)

    monkeypatch.setattr(experts_mod, "_measured", {})
    monkeypatch.setitem(experts_mod.PRODUCTS, "kernel", slow)
    assert experts_mod.faster_product(("kernel", "bucketed"), 64, 32, 4, 1000) == "bucketed"
    assert calls == [1024] * 4  # rounded up to a power of two; one warm-up run and the best of three
    assert experts_mod.faster_product(("kernel", "bucketed"), 64, 32, 4, 900) == "bucketed"
    assert len(calls) == 4  # the same rounded shape: not timed again
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as full validation asks
        assert experts_mod.faster_product(("kernel", "bucketed"), 64, 32, 4, 3000) == "bucketed"
    assert calls[4:] == [4096] * 4


def test_auto_in_bf16_on_the_cpu_pads_big_groups_and_groups_small_ones(monkeypatch):
    """bf16 CPU without AVX512_BF16: the bucketed loop from BUCKETED_ROWS rows per expert (the demo's 4096
    tokens over 8 experts), grouped_mm below it, or the padded bmm where grouped_mm cannot run
    (measured 2026-12-01, see git history of benchmarks/RESULTS.md)."""
    from nanollama4.ops.experts import BUCKETED_ROWS, ROW_MULTIPLE, auto_product, chosen_product

    monkeypatch.setattr(kernels, "bf16_available", lambda: False)
    bf16 = torch.zeros(0, 256, dtype=torch.bfloat16)
    assert auto_product(torch.zeros(4096, 256, dtype=torch.bfloat16), 384, 8) == "bucketed"
    assert auto_product(bf16, 384, 8, rows=4096) == chosen_product("auto", bf16, 384, 8, 4096) == "bucketed"
    assert auto_product(bf16, 384, 8, rows=BUCKETED_ROWS * 8 - 1) == "grouped"
    assert auto_product(torch.zeros(0, 6, dtype=torch.bfloat16), 5, 8, rows=100) == "padded"  # grouped_mm cannot
    assert auto_product(torch.zeros(0, 6, dtype=torch.bfloat16), 5, 8, rows=4096) == "bucketed"
    assert ROW_MULTIPLE == {"bucketed": 32}


@pytest.mark.parametrize("contiguous", [True, False])
def test_bucketed_product_gradients_in_float64(contiguous):
    """The hand-written backward against autograd's numerical gradients: empty groups, odd sizes, and an
    incoming gradient that is not contiguous."""
    from nanollama4.ops.experts import bucketed_product

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    experts = torch.repeat_interleave(torch.arange(4), counts)
    x = torch.randn(9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    gate_up = torch.randn(4, 6, 10, dtype=torch.float64, generator=g, requires_grad=True)
    down = torch.randn(4, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)

    def f(x, gate_up, down):
        y = bucketed_product(x, gate_up, down, counts, experts)
        return y if contiguous else y.t().contiguous().t()  # same values, a transposed-stride gradient

    assert torch.autograd.gradcheck(f, (x, gate_up, down))
    y = bucketed_product(x, gate_up, down, counts, experts)
    torch.testing.assert_close(y, PRODUCTS["loop"](x, gate_up, down, counts, experts))


def test_a_plain_transformer_holds_only_the_papers_modules_and_the_installed_one_computes_the_same():
    """`Transformer(cfg)` is plain (what print(model) shows is the math of model/transformer.py, attention.py and
    moe.py); `build_model` / `ops.install` swap in the fast modules, on the same parameters, with the same
    logits and gradients (fp32: our kernel and FastLinear sum in another order, hence the tolerance)."""
    from nanollama4.model.attention import Attention, sdpa_attend
    from nanollama4.model.moe import Experts, SwiGLU
    from nanollama4.model.router import Float32Linear, SigmoidRouter
    from nanollama4.model.transformer import Block, RMSNorm
    from nanollama4.ops.experts import FastExperts

    cfg = preset("tiny", moe_every=2)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    plain_types = {Transformer, nn.Embedding, nn.ModuleList, Block, RMSNorm, Attention, nn.Linear, Float32Linear,
                   MoE, Experts, SwiGLU, SigmoidRouter}
    assert {type(m) for m in plain.modules()} <= plain_types
    assert all(m.attend is sdpa_attend for m in plain.modules() if isinstance(m, Attention))
    assert "Fast" not in repr(plain)

    torch.manual_seed(0)
    fast = build_model(cfg)
    assert sum(isinstance(m, FastExperts) for m in fast.modules()) == 2
    assert sum(isinstance(m, FastLinear) for m in fast.modules()) == 3 * 4
    assert list(fast.state_dict()) == list(plain.state_dict())  # the same names: checkpoints load either way
    for (name, p), q in zip(plain.state_dict().items(), fast.state_dict().values(), strict=True):
        assert torch.equal(p, q), name  # the same initial weights from the same seed
    assert install(fast) is fast and sum(isinstance(m, FastExperts) for m in fast.modules()) == 2  # idempotent

    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    for model in (plain, fast):
        model.loss(ids, ids).total.backward()
    with torch.no_grad():
        torch.testing.assert_close(fast.eval()(ids), plain.eval()(ids), atol=2e-5, rtol=1e-4)
    for (name, p), q in zip(plain.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=2e-6, rtol=1e-4, msg=name)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():  # bf16: the kernel's bf16 path or bmm
        torch.testing.assert_close(fast(ids).float(), plain(ids).float(), atol=0.1, rtol=0.05)


# -------------------------------------------------------------------------------------------- attention

def test_autocast_training_attention_uses_explicit_scores():
    """Under CPU bf16 autocast with gradients, attention takes `scores_attention` (bf16 products, no SDPA);
    without gradients it takes bf16 SDPA. The outputs agree to bf16 rounding, and gradients reach the
    projections in their float32 dtype. The NoPE layer's temperature keeps q in bf16 (it used to turn
    it back to float32 and leave the bf16 path)."""
    for layer, overrides in ((0, dict(nope_interval=0)), (0, dict(nope_interval=1))):
        cfg = preset("tiny", n_experts=0, attention_chunk_size=None, **overrides)
        torch.manual_seed(0)
        attn = ops.install(Attention(cfg, layer=layer))
        x, pos = torch.randn(2, 9, cfg.d_model), torch.arange(9)
        rope = rope_angles(rope_frequencies(cfg), pos)
        with mock.patch.object(F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as sdpa, \
                mock.patch("nanollama4.ops.attention.scores_attention", wraps=scores_attention) as scores:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = attn(x, pos, rope)
                with torch.no_grad():
                    want = attn(x, pos, rope)
        assert [call.args[0].dtype for call in scores.call_args_list] == [torch.bfloat16], overrides
        assert [call.args[0].dtype for call in sdpa.call_args_list] == [torch.bfloat16], overrides
        assert out.dtype == want.dtype == torch.bfloat16
        assert (out.float() - want.float()).abs().max() <= 0.02 * want.abs().max()
        out.float().sum().backward()
        assert attn.q_proj.weight.grad is not None and attn.q_proj.weight.grad.dtype == torch.float32


def test_autocast_training_attention_falls_back_to_float32_flash_when_scores_are_too_big():
    """Past SCORES_LIMIT score elements the explicit score matrix would cost too much memory: attention then
    runs float32 SDPA instead, with the same result to bf16 rounding."""
    cfg = preset("tiny", n_experts=0, nope_interval=0, attention_chunk_size=None)
    torch.manual_seed(0)
    attn = ops.install(Attention(cfg, layer=0))
    x, pos = torch.randn(2, 9, cfg.d_model), torch.arange(9)
    rope = rope_angles(rope_frequencies(cfg), pos)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = attn(x, pos, rope)
        with mock.patch("nanollama4.ops.attention.SCORES_LIMIT", 2 * cfg.n_heads * 9 * 9 - 1), \
                mock.patch.object(F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as sdpa:
            out = attn(x, pos, rope)
    assert [call.args[0].dtype for call in sdpa.call_args_list] == [torch.float32]
    assert out.dtype == torch.bfloat16
    assert (out.float() - want.float()).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 1), (3, 3)])
def test_scores_attention_matches_sdpa(heads, kv_heads, chunk):
    """float32, GQA, causal or chunked masks, per-row masks with left padding: the same outputs and input
    gradients as torch's SDPA with the same mask (1e-5)."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    B, T, Dh = 2, 7, 8
    q = torch.randn(B, T, heads, Dh, generator=g, requires_grad=True)
    k = torch.randn(B, T, kv_heads, Dh, generator=g, requires_grad=True)
    v = torch.randn(B, T, kv_heads, Dh, generator=g, requires_grad=True)
    w = torch.randn(B, T, heads, Dh, generator=g)
    shared = torch.arange(T)
    rows = torch.stack([shared, shared - 2])  # second row left-padded by two slots (negative positions)
    for pos in (shared, rows):
        mask = attention_mask(pos, pos, chunk)
        ours = scores_attention(q, k, v, mask)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        got = torch.autograd.grad((ours * w).sum(), (q, k, v))
        want = torch.autograd.grad((ref * w).sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale_input", [True, False])
def test_every_expert_on_every_row_equals_the_sorted_experts(scale_input):
    """The compiled decode step's path for batches with more assignments than experts: weight 0 for the
    experts a row did not choose gives the sum over its chosen experts only."""
    from nanollama4.model.moe import Experts

    g = torch.Generator().manual_seed(4)
    experts = Experts(4, 32, 24)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(experts.gate_up.shape, generator=g) * 0.2)
        experts.down.copy_(torch.randn(experts.down.shape, generator=g) * 0.2)
    x = torch.randn(6, 32, generator=g)
    token = torch.arange(6).repeat_interleave(2)
    expert = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)]).flatten()
    weight = torch.rand(12, generator=g)
    with torch.no_grad():
        want = experts(x, token, expert, weight, scale_input)
        got = experts_mod.every_expert(x, token, expert, weight, experts.gate_up, experts.down, scale_input,
                                       torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.abs().max() > 0.01
