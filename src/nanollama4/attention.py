"""Grouped-query attention with Llama 4's two layer kinds.

RoPE layers: rotary positions, weightless QK-norm, and (optionally) chunked local attention, where a
token sees only the earlier tokens of its own fixed block of `chunk` positions.
NoPE layers: no positional embedding, full causal attention, and queries scaled up slowly with their
position ("temperature tuning") so attention stays sharp over very long contexts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import Rope, apply_rope


def rms_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim with no gain (the reference's "L2Norm" of q and k), in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where query i may attend to key j: causal, and same chunk if chunked."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if chunk is not None:
        allowed = allowed & (q_pos[:, None] // chunk == k_pos[None, :] // chunk)
    return allowed


def temperature_scale(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)), float32, shape (T,)."""
    p = positions.to(torch.float32)
    return 1.0 + attn_scale * torch.log1p(torch.floor((p + 1.0) / floor_scale))


class Attention(nn.Module):
    """Multi-head attention where n_rep query heads share each key/value head (GQA)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.use_rope = cfg.uses_rope(layer)
        self.chunk = cfg.chunk_size(layer)
        self.qk_norm = cfg.use_qk_norm and self.use_rope
        self.temperature = cfg.attn_temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale, self.eps = cfg.floor_scale, cfg.attn_scale, cfg.norm_eps
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x (B, T, d) at absolute positions (T,) -> (B, T, d). `rope` holds cos, sin (T, Dh/2)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, Dh)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, KV, Dh)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if self.qk_norm:
                q, k = rms_unit(q, self.eps), rms_unit(k, self.eps)
        elif self.temperature:
            scale = temperature_scale(positions, self.floor_scale, self.attn_scale)
            q = (q * scale[:, None, None]).to(x.dtype)
        out = self._attend(q, k, v, positions, positions)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Scaled dot-product attention over (B, T, heads, Dh) inputs; returns (B, Tq, H, Dh)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, Dh)
        same_span = q_pos.shape[0] == k_pos.shape[0]
        if self.chunk is None and same_span and q.shape[-2] > 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            mask = attention_mask(q_pos, k_pos, self.chunk)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)  # (B, Tq, H, Dh)
