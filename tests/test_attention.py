"""Attention against a naive computation written out here: chunked local attention on RoPE layers, NoPE layers
with temperature, QK-norm. float32, fixed seeds."""

from __future__ import annotations

import math

import pytest
import torch

from nanollama4.base.config import ModelConfig
from nanollama4.model.attention import BY_CHUNKS, Attention
from nanollama4.model.rope import apply_rope, rope_angles, rope_frequencies
from nanollama4.ops.attention import cpu_autocast_attend
from tests.helpers import randomize_

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


@pytest.mark.parametrize("length", [3, 4, 11, 12])
@pytest.mark.parametrize("backend", ["sdpa", "cpu autocast"])
def test_a_whole_sequence_from_a_chunk_boundary_attends_chunk_by_chunk(length, backend):
    """With `start` given (no cache, positions start, start+1, ...), a chunked layer cuts the sequence into
    its chunks, each a causal pass of its own (`by_chunks`): the naive chunk mask's attention, for whole
    chunks and a shorter last one. Where the start is not a chunk boundary, the masked pass is taken."""
    cfg, attn = _attention(0)
    if backend == "cpu autocast":
        attn.attend = cpu_autocast_attend
    x = torch.randn(2, length, cfg.d_model, generator=torch.Generator().manual_seed(8))
    positions = torch.arange(length)
    calls = []
    inner = attn.attend
    attn.attend = lambda q, k, v, qp, kp, chunk, mask: calls.append((q.shape[:2], chunk)) or inner(q, k, v, qp, kp,
                                                                                                chunk, mask)
    BY_CHUNKS.add(attn.attend)
    try:
        with torch.no_grad():
            got = attn(x, positions, rope_angles(rope_frequencies(cfg), positions), start=0)
            want = naive_attention(cfg, attn, x, layer=0)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            whole, rest = divmod(length, 4)
            assert calls == [((2 * whole, 4), None)] * (whole > 0) + [((2, rest), None)] * (rest > 0)
            calls.clear()
            attn(x, positions + 2, rope_angles(rope_frequencies(cfg), positions + 2), start=2)
            assert calls == [((2, length), 4)]  # (starts mid-chunk: one masked pass)
    finally:
        BY_CHUNKS.discard(attn.attend)


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
