"""Property tests of the model's parts against independent computations written out here.

float32 throughout unless a test says otherwise; fixed seeds; tolerances are stated in each test.
"""

from __future__ import annotations

import copy
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from helpers import randomize_
from nanollama4 import ops
from nanollama4.attention import Attention, attention_mask
from nanollama4.config import ModelConfig, preset
from nanollama4.moe import MoE, moe_reference
from nanollama4.ops import build_model, install
from nanollama4.ops import experts as experts_ops
from nanollama4.ops.attention import scores_attention
from nanollama4.ops.experts import grouped_mm_ok as _grouped_mm_ok
from nanollama4.rope import apply_rope, rope_angles, rope_frequencies

# ---------------------------------------------------------------------------------------------------- RoPE

ROPE_CONFIGS = {
    "plain16": dict(head_dim=16, n_heads=4, n_kv_heads=2),
    "plain32": dict(head_dim=32, n_heads=4, n_kv_heads=2),
    "llama3_16": dict(head_dim=16, n_heads=4, n_kv_heads=2, rope_scaling=8.0, rope_original_max_len=16,
                      rope_high_freq_factor=4.0),
    "llama3_32": dict(head_dim=32, n_heads=4, n_kv_heads=2, rope_scaling=8.0, rope_original_max_len=16,
                      rope_high_freq_factor=4.0),
}


def _rotate(cfg: ModelConfig, x: torch.Tensor, pos: int) -> torch.Tensor:
    """x (Dh,) rotated as a token at position pos -> (Dh,)."""
    rot = rope_angles(rope_frequencies(cfg), torch.tensor([pos]))
    return apply_rope(x.view(1, 1, 1, -1), rot).view(-1)


@pytest.mark.parametrize("name", sorted(ROPE_CONFIGS))
def test_rope_dot_product_depends_only_on_relative_position(name):
    cfg = ModelConfig(**ROPE_CONFIGS[name])
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        q, k = torch.randn(cfg.head_dim, generator=g), torch.randn(cfg.head_dim, generator=g)
        dots = [torch.dot(_rotate(cfg, q, m), _rotate(cfg, k, n)).item() for m, n in ((3, 1), (12, 10), (40, 38))]
        assert dots[1] == pytest.approx(dots[0], abs=1e-4)
        assert dots[2] == pytest.approx(dots[0], abs=1e-4)
        # another distance gives another score (RoPE does encode position)
        other = torch.dot(_rotate(cfg, q, 7), _rotate(cfg, k, 1)).item()
        assert abs(other - dots[0]) > 1e-3
        # same position: the plain dot product (rotation is orthogonal)
        same = torch.dot(_rotate(cfg, q, 9), _rotate(cfg, k, 9)).item()
        assert same == pytest.approx(torch.dot(q, k).item(), abs=1e-4)


@pytest.mark.parametrize("name", sorted(ROPE_CONFIGS))
def test_apply_rope_preserves_norm(name):
    cfg = ModelConfig(**ROPE_CONFIGS[name])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 50, 3, cfg.head_dim, generator=g)
    y = apply_rope(x, rope_angles(rope_frequencies(cfg), torch.arange(50)))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    # and it is not the identity (except at position 0)
    assert (y[:, 1:] - x[:, 1:]).abs().max() > 0.1
    torch.testing.assert_close(y[:, 0], x[:, 0], atol=0, rtol=0)


def test_apply_rope_rotates_adjacent_pairs():
    """Pair i of x = (x[2i], x[2i+1]) is the complex number x[2i] + j x[2i+1], multiplied by exp(j pos theta_i)."""
    cfg = ModelConfig(head_dim=8, n_heads=2, n_kv_heads=1, rope_theta=100.0)
    x = torch.randn(1, 5, 1, 8, generator=torch.Generator().manual_seed(2))
    y = apply_rope(x, rope_angles(rope_frequencies(cfg), torch.arange(5)))
    for p in range(5):
        for i in range(4):
            z = complex(x[0, p, 0, 2 * i].item(), x[0, p, 0, 2 * i + 1].item())
            w = z * complex(math.cos(p * 100.0 ** (-2 * i / 8)), math.sin(p * 100.0 ** (-2 * i / 8)))
            assert y[0, p, 0, 2 * i].item() == pytest.approx(w.real, abs=1e-5)
            assert y[0, p, 0, 2 * i + 1].item() == pytest.approx(w.imag, abs=1e-5)


@pytest.mark.parametrize("head_dim,theta", [(16, 10000.0), (32, 10000.0), (128, 500000.0)])
def test_rope_frequencies_plain(head_dim, theta):
    cfg = ModelConfig(head_dim=head_dim, n_heads=4, n_kv_heads=2, rope_theta=theta)
    want = torch.tensor([theta ** (-2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64)
    got = rope_frequencies(cfg)
    assert got.dtype == torch.float32 and got.shape == (head_dim // 2,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_llama3_scaling_scout_values():
    """factor 16, low = high = 1, L0 8192: exactly the wavelengths > 8192 are slowed 16x; no NaN from low == high."""
    cfg = ModelConfig(head_dim=128, n_heads=4, n_kv_heads=2, rope_theta=5e5, rope_scaling=16.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=1.0, rope_original_max_len=8192)
    base = [5e5 ** (-2 * i / 128) for i in range(64)]
    wavelengths = [2 * math.pi / f for f in base]
    assert min(abs(w / 8192 - 1) for w in wavelengths) > 1e-3  # none within float32 rounding of 8192
    slowed = [w > 8192 for w in wavelengths]
    assert 0 < sum(slowed) < 64  # both kinds occur
    want = torch.tensor([f / 16 if s else f for f, s in zip(base, slowed, strict=True)], dtype=torch.float64)
    got = rope_frequencies(cfg)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_llama3_scaling_band_blends():
    """factor 8, low 1, high 4, L0 64: the published llama3 formula, written out per frequency."""
    factor, low, high, L0 = 8.0, 1.0, 4.0, 64
    cfg = ModelConfig(head_dim=32, n_heads=4, n_kv_heads=2, rope_theta=10000.0, rope_scaling=factor,
                      rope_low_freq_factor=low, rope_high_freq_factor=high, rope_original_max_len=L0)
    want, kinds = [], set()
    for i in range(16):
        f = 10000.0 ** (-2 * i / 32)
        wl = 2 * math.pi / f
        if wl < L0 / high:
            want.append(f)
            kinds.add("keep")
        elif wl > L0 / low:
            want.append(f / factor)
            kinds.add("slow")
        else:
            s = (L0 / wl - low) / (high - low)
            want.append((1 - s) * f / factor + s * f)
            kinds.add("band")
    assert kinds == {"keep", "slow", "band"}
    torch.testing.assert_close(rope_frequencies(cfg).double(), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------- causality

@pytest.mark.parametrize("overrides", [{}, dict(attention_chunk_size=4, nope_interval=2), dict(n_experts=0)],
                         ids=["tiny", "chunk4_nope2", "tiny_dense"])
def test_changing_a_token_never_changes_earlier_logits(overrides):
    """Dense: earlier logits are bit-identical. MoE: changing token t regroups the rows the experts multiply, which
    can change float32 rounding of other rows by a few ulp (seen: 1.4e-6 on logits ~2.4), so atol 1e-6 + rtol 1e-5
    there; a real leak through attention moves them by > 1e-2."""
    cfg = preset("tiny", **overrides)
    tol = dict(atol=0.0, rtol=0.0) if cfg.n_experts == 0 else dict(atol=1e-6, rtol=1e-5)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    randomize_(model, seed=3)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=g)
    with torch.no_grad():
        base = model(ids)
        for t in (0, 3, 4, 9, 19):
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 1 + torch.randint(0, cfg.vocab_size - 1, (2,), generator=g)) \
                % cfg.vocab_size
            assert (changed[:, t] != ids[:, t]).all()
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], **tol)
            assert (out[:, t] - base[:, t]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------- attention

ATTN_CFG = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, n_layers=4, nope_interval=4,
                attention_chunk_size=4, floor_scale=2, attn_scale=0.5, use_qk_norm=True, attn_temperature_tuning=True)


def _attention(layer: int, **overrides) -> tuple[ModelConfig, Attention]:
    cfg = ModelConfig(**{**ATTN_CFG, **overrides})
    torch.manual_seed(0)
    attn = Attention(cfg, layer).eval()
    randomize_(attn, seed=10 + layer)
    return cfg, attn


def _run(cfg: ModelConfig, attn: Attention, x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[1])
    with torch.no_grad():
        return attn(x, positions, rope_angles(rope_frequencies(cfg), positions))


def naive_attention(cfg: ModelConfig, attn: Attention, x: torch.Tensor, layer: int) -> torch.Tensor:
    """Attention written out head by head with explicit masks; only the layer's weights and rope.py are shared."""
    B, T, _ = x.shape
    H, KV, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    use_rope = (layer + 1) % cfg.nope_interval != 0
    q = (x @ attn.q_proj.weight.T).view(B, T, H, Dh)
    k = (x @ attn.k_proj.weight.T).view(B, T, KV, Dh)
    v = (x @ attn.v_proj.weight.T).view(B, T, KV, Dh)
    if use_rope:
        rot = rope_angles(rope_frequencies(cfg), torch.arange(T))
        q, k = apply_rope(q, rot), apply_rope(k, rot)
        if cfg.use_qk_norm:
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
        chunk = cfg.attention_chunk_size
    else:
        if cfg.attn_temperature_tuning:
            scale = torch.tensor([1 + cfg.attn_scale * math.log(1 + math.floor((p + 1) / cfg.floor_scale))
                                  for p in range(T)])
            q = q * scale[None, :, None, None]
        chunk = None
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            mask[i, j] = j <= i and (chunk is None or i // chunk == j // chunk)
    heads = []
    for h in range(H):
        kv = h // (H // KV)  # GQA: consecutive query heads share a key/value head
        scores = torch.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, kv]) / math.sqrt(Dh)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(torch.einsum("bqk,bkd->bqd", scores.softmax(-1), v[:, :, kv]))
    out = torch.cat(heads, dim=-1)  # (B, T, H*Dh), head-major like the projection
    return out @ attn.o_proj.weight.T


def test_chunked_attention_ignores_earlier_chunks():
    cfg, attn = _attention(0)
    assert attn.use_rope and attn.chunk == 4
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 12, cfg.d_model, generator=g)
    base = _run(cfg, attn, x)
    for t in range(8):  # chunks 0 and 1
        y = x.clone()
        y[:, t] += torch.randn(cfg.d_model, generator=g)
        out = _run(cfg, attn, y)
        torch.testing.assert_close(out[:, 8:12], base[:, 8:12], atol=1e-6, rtol=0)
    y = x.clone()
    y[:, 8] += torch.randn(cfg.d_model, generator=g)  # first position of chunk 2
    assert (_run(cfg, attn, y)[:, 9] - base[:, 9]).abs().max() > 1e-3


@pytest.mark.parametrize("qk_norm", [True, False])
def test_chunked_rope_attention_matches_naive(qk_norm):
    cfg, attn = _attention(0, use_qk_norm=qk_norm)
    x = torch.randn(2, 11, cfg.d_model, generator=torch.Generator().manual_seed(6))
    got = _run(cfg, attn, x)
    with torch.no_grad():
        want = naive_attention(cfg, attn, x, layer=0)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_nope_attention_with_temperature_matches_naive():
    """Layer 3 of nope_interval 4: no rope, no QK norm, full causal (the chunk does not apply), tuned queries."""
    cfg, attn = _attention(3)
    assert not attn.use_rope and attn.chunk is None
    x = torch.randn(2, 12, cfg.d_model, generator=torch.Generator().manual_seed(7))
    got = _run(cfg, attn, x)
    with torch.no_grad():
        want = naive_attention(cfg, attn, x, layer=3)
        # the temperature matters here: without it the answer differs
        plain = naive_attention(cfg.replace(attn_temperature_tuning=False), attn, x, layer=3)
    assert (want - plain).abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- MoE

MOE_SHAPES = {
    "grouped": dict(d_model=64, expert_dim=32, n_heads=4, n_kv_heads=2, head_dim=16),
    "fallback": dict(d_model=6, expert_dim=5, n_heads=2, n_kv_heads=1, head_dim=4),
}


def _moe(shape: str, router: str, k: int, n: int, seed: int = 0) -> tuple[ModelConfig, MoE]:
    cfg = ModelConfig(**MOE_SHAPES[shape], n_experts=n, experts_per_token=k, router=router)
    torch.manual_seed(seed)
    moe = install(MoE(cfg))
    # std 1.5/sqrt(fan_in): ~0.6 for the d_model 6 shape, outputs O(1..10) for both shapes
    randomize_(moe, seed=100 + seed, gain=1.5)
    return cfg, moe


@pytest.mark.parametrize("shape", sorted(MOE_SHAPES))
@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("n", [4, 8])
def test_moe_sparse_equals_dense_reference(shape, router, k, n):
    cfg, moe = _moe(shape, router, k, n)
    # the premise: grouped_mm accepts the first shape's strides, not the second's; each shape runs every
    # product it allows, and the spies below check that the one named is the one that ran
    aligned = shape == "grouped"
    assert _grouped_mm_ok(torch.empty(1, cfg.d_model), cfg.expert_dim) == aligned
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 13, cfg.d_model, generator=g)
    w = torch.randn(2, 13, cfg.d_model, generator=g)  # random cotangent: every output element matters

    def run(fn):
        moe.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = fn(moe, xi)
        (y * w).sum().backward()
        return y.detach(), xi.grad, {name: p.grad.clone() for name, p in moe.named_parameters()}

    y_ref, gx_ref, gp_ref = run(moe_reference)
    assert y_ref.abs().max() > 1.0
    for mode in ["kernel", "loop", "padded", "bucketed"] + (["grouped"] if aligned else []):
        moe.experts.dispatch = mode
        with mock.patch.object(F, "grouped_mm", wraps=F.grouped_mm) as grouped, \
                mock.patch.object(experts_ops._KernelSwiGLU, "apply", wraps=experts_ops._KernelSwiGLU.apply) as kernel:
            y, gx, gp = run(lambda m, xi: m(xi))
        assert (grouped.called, kernel.called) == (mode == "grouped", mode == "kernel"), mode
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5, msg=mode)
        torch.testing.assert_close(gx, gx_ref, atol=1e-5, rtol=1e-5, msg=mode)
        assert gp.keys() == gp_ref.keys() and {"router.weight", "experts.gate_up", "experts.down"} <= gp.keys()
        for name in gp:
            torch.testing.assert_close(gp[name], gp_ref[name], atol=1e-5, rtol=1e-5, msg=f"{mode}: {name}")
    # the router learns through the expert weights, except softmax top-1, whose single weight is always 1
    assert (gp["router.weight"].abs().max() > 0) == (router == "sigmoid" or k > 1)


def moe_by_hand(moe: MoE, x: torch.Tensor, router: str, k: int) -> torch.Tensor:
    """Token by token: top-k of the router logits, each chosen expert's SwiGLU, weighted, summed, + shared."""
    T, d = x.shape
    hidden = moe.experts.gate_up.shape[-1] // 2
    silu = lambda z: z * torch.sigmoid(z)  # noqa: E731
    out = torch.zeros(T, d)
    for t in range(T):
        logits = [float(torch.dot(x[t], moe.router.weight[e])) for e in range(moe.n_experts)]
        chosen = sorted(range(moe.n_experts), key=lambda e: -logits[e])[:k]
        if router == "softmax":
            z = sum(math.exp(logits[e]) for e in chosen)
            weights = [math.exp(logits[e]) / z for e in chosen]
        else:
            weights = [1 / (1 + math.exp(-logits[e])) for e in chosen]
        for e, wgt in zip(chosen, weights, strict=True):
            inp = x[t] * wgt if router == "sigmoid" else x[t]
            gate = inp @ moe.experts.gate_up[e][:, :hidden]
            up = inp @ moe.experts.gate_up[e][:, hidden:]
            y = (silu(gate) * up) @ moe.experts.down[e]
            out[t] += y if router == "sigmoid" else wgt * y
        se = moe.shared_expert
        out[t] += (silu(se.gate_proj.weight @ x[t]) * (se.up_proj.weight @ x[t])) @ se.down_proj.weight.T
    return out


@pytest.mark.parametrize("shape", sorted(MOE_SHAPES))
@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
@pytest.mark.parametrize("k", [1, 2])
def test_moe_matches_per_token_loop(shape, router, k):
    cfg, moe = _moe(shape, router, k, 8, seed=2)
    x = torch.randn(1, 9, cfg.d_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = moe(x)[0]
        want = moe_by_hand(moe, x[0], router, k)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shape", sorted(MOE_SHAPES))
@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_unchosen_experts_contribute_nothing(shape, router):
    cfg, moe = _moe(shape, router, 1, 8, seed=4)
    x = torch.randn(1, 3, cfg.d_model, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        chosen = set((x[0] @ moe.router.weight.T).argmax(-1).tolist())  # k = 1: the argmax of the logits
        unchosen = sorted(set(range(8)) - chosen)
        assert len(unchosen) >= 5
        base = moe(x)
        for fill in ("zero", "random"):
            m = copy.deepcopy(moe)
            for e in unchosen:
                if fill == "zero":
                    m.experts.gate_up[e].zero_()
                    m.experts.down[e].zero_()
                else:
                    m.experts.gate_up[e].normal_(std=10.0)
                    m.experts.down[e].normal_(std=10.0)
            torch.testing.assert_close(m(x), base, atol=0, rtol=0)
        # whereas changing a chosen expert does change the output
        m = copy.deepcopy(moe)
        m.experts.down[min(chosen)].zero_()
        assert (m(x) - base).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------- loss, bf16

def test_loss_is_cross_entropy_with_ignore_index():
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    randomize_(model, seed=8)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    with torch.no_grad():
        logits = model(ids).double()
        # cross-entropy by hand: logsumexp - logit of the target, averaged over the kept positions
        nll = torch.logsumexp(logits, -1) - logits.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        loss = model.loss(ids, targets)
        assert loss.lm.item() == pytest.approx(nll.mean().item(), abs=1e-5)
        assert loss.total.item() == pytest.approx(loss.lm.item(), abs=0) and loss.aux.item() == 0.0
        assert loss.lm.item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item(),
                                               abs=1e-5)
        masked = targets.clone()
        keep = torch.rand(2, 10, generator=g) < 0.5
        keep[0, 0] = True
        keep[1, 1] = False
        masked[~keep] = -100
        got = model.loss(ids, masked).lm.item()
        assert got == pytest.approx(nll[keep].mean().item(), abs=1e-5)
        assert abs(got - nll.mean().item()) > 1e-4


@pytest.mark.parametrize("randomized", [False, True], ids=["tiny_init", "dense_random"])
def test_bf16_logits_close_to_float32(randomized):
    """The tiny model as initialised; and a dense variant with random weights (with MoE, bf16 rounding can flip
    a token's top-k choice, a legitimate but discontinuous change, so random weights are tested dense)."""
    cfg = preset("tiny", n_experts=0) if randomized else preset("tiny")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    if randomized:
        randomize_(model, seed=11)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        want = model(ids)
        half = copy.deepcopy(model).to(torch.bfloat16)
        got = half(ids)
    assert got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    err = (got.float() - want).abs().max()
    assert err <= 0.1 * want.abs().max()
    # at the default init the feed-forward layers move the logits little; the bf16 model must still be much
    # closer than a model without them (the tolerance above alone passes one that skips every FFN)
    no_ffn = copy.deepcopy(model)
    for block in no_ffn.blocks:
        block.ffn.forward = torch.zeros_like
    with torch.no_grad():
        assert err < (no_ffn(ids) - want).abs().max() / 3


def test_bf16_model_keeps_rope_frequencies_exact():
    """Casting the model to bf16 must not round the RoPE frequencies: at position 8191 (one Llama 4 chunk)
    a bf16-rounded theta_i is off by up to ~1.5 rad, so the rotation is meaningless at long context."""
    cfg = preset("tiny")
    model = build_model(cfg).to(torch.bfloat16)
    want = 8191.0 * rope_frequencies(cfg).double()
    assert model.inv_freq(torch.device("cpu")).dtype == torch.float32
    got = 8191.0 * model.inv_freq(torch.device("cpu")).double()
    assert (got - want).abs().max().item() < 1e-2


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


def test_rmsnorm_under_autocast_hands_out_the_autocast_dtype():
    """Under CPU bf16 autocast the norm's output is already bf16 (one cast for all its readers): the float32
    result rounded once, with the gain's gradient still in float32."""
    from nanollama4.model import RMSNorm
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, norm(x).to(torch.bfloat16))
    out.float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32


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
