"""Rotary position embeddings (RoPE) on interleaved pairs, with llama3-style frequency scaling.

Llama 4 rotates adjacent pairs (x[2i], x[2i+1]) by angle pos * theta_i, i.e. it treats each head as
head_dim/2 complex numbers. (Llama 2/3 in transformers rotate the two halves instead; the two are not
interchangeable for the same weights.)
"""

from __future__ import annotations

import math

import torch

from ..base.config import ModelConfig

Rope = torch.Tensor  # (cos, sin) of pos * theta_j stacked last, float32, (..., T, head_dim/2, 2)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """theta_i = base^(-2i/head_dim) for i < head_dim/2, float32, llama3-scaled when configured."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)  # (Dh/2,)
    if cfg.rope_scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, cfg.rope_scaling, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                         cfg.rope_original_max_len)


def _llama3_scale(inv_freq: torch.Tensor, factor: float, low: float, high: float, original_len: int) -> torch.Tensor:
    """Slow down long-wavelength frequencies by `factor`, keep short ones, blend the band in between.

    Wavelengths longer than original_len/low were never seen whole in training, so they are stretched;
    those shorter than original_len/high stay. Selecting with `where` (rather than blending with masks)
    keeps the band formula's division by zero when low == high out of the result.
    """
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original_len / low, original_len / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    if high > low:
        smooth = (original_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        scaled = torch.where(in_band, blended, scaled)
    return scaled


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> Rope:
    """cos and sin of pos * theta_i, float32, stacked in a last dim: (..., T, Dh/2, 2) for positions (..., T).

    Read as complex numbers, these are the unit rotations e^(i pos theta_i). Computed once per forward
    pass and shared by every RoPE layer.
    """
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rot: Rope) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of x (B, T, H, Dh) by the rotations rot ((B,) T, Dh/2, 2).

    Each pair is the complex number x[2i] + i x[2i+1], so the rotation is one complex product:
    (x0 cos - x1 sin, x0 sin + x1 cos). Computed in float32 and cast back, as the reference does, so
    bf16 models rotate accurately.
    """
    rot = rot.unsqueeze(-3)  # broadcast over heads
    xf = x.float().contiguous().unflatten(-1, (-1, 2))  # (B, T, H, Dh/2, 2); complex views need contiguity
    if torch.compiler.is_compiling():  # inductor generates no code for complex numbers: spell it out
        x0, x1, c, s = xf[..., 0], xf[..., 1], rot[..., 0], rot[..., 1]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)
    rotated = torch.view_as_complex(xf) * torch.view_as_complex(rot)  # one kernel in eager mode
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def shifted_scores(cfg: ModelConfig, pairs: tuple[tuple[int, int], ...] = ((5, 2), (40, 7), (300, 300)),
                   shifts: tuple[int, ...] = (0, 1, 1000, 100000), seed: int = 0) -> list[tuple[int, int, list[float]]]:
    """RoPE scores depend only on relative position, shown: one random query and key (cfg's head_dim),
    rotated to positions (m + s, n + s) for each shift s. q·k is the same for every s, up to float32
    rounding, because rotating both by s multiplies the score by e^(i s θ) and its conjugate.
    Returns (m, n, [score for each shift]) per pair (`nanollama4 rope-check` prints them)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, 1, cfg.head_dim, generator=g)  # (B, T, H, Dh) each
    inv_freq = rope_frequencies(cfg)
    rows = []
    for m, n in pairs:
        scores = []
        for s in shifts:
            qm = apply_rope(q, rope_angles(inv_freq, torch.tensor([m + s])))
            kn = apply_rope(k, rope_angles(inv_freq, torch.tensor([n + s])))
            scores.append(float((qm * kn).sum()))
        rows.append((m, n, scores))
    return rows
