"""RoPE: rotation of adjacent pairs, relative positions only, plain and Llama 3-scaled frequencies, exact in bf16
models."""

from __future__ import annotations

import math

import pytest
import torch

from nanollama4.base.config import ModelConfig, preset
from nanollama4.model.rope import apply_rope, rope_angles, rope_frequencies
from nanollama4.ops import build_model

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


def test_bf16_model_keeps_rope_frequencies_exact():
    """Casting the model to bf16 must not round the RoPE frequencies: at position 8191 (one Llama 4 chunk)
    a bf16-rounded theta_i is off by up to ~1.5 rad, so the rotation is meaningless at long context."""
    cfg = preset("tiny")
    model = build_model(cfg).to(torch.bfloat16)
    want = 8191.0 * rope_frequencies(cfg).double()
    assert model.inv_freq(torch.device("cpu")).dtype == torch.float32
    got = 8191.0 * model.inv_freq(torch.device("cpu")).double()
    assert (got - want).abs().max().item() < 1e-2
