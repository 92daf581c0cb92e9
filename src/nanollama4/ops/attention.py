"""Attention backends: how the scores are computed, installed into `Attention.attend` from outside.

`attention.sdpa_attend` (torch's fused scaled_dot_product_attention) is the plain backend. Training
under CPU bf16 autocast is where torch 2.13's fused kernels are slow, so `cpu_autocast_attend` computes
the scores explicitly there (`scores_attention`), up to SCORES_LIMIT score elements, past which it
falls back to float32 SDPA; everywhere else it is sdpa_attend.
"""

from __future__ import annotations

import torch

from ..model.attention import BY_CHUNKS, attention_mask, sdpa_attend

SCORES_LIMIT = 1 << 24  # score elements (B * H * Tq * Tk) up to which training attention uses explicit scores


def cpu_autocast_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, chunk: int | None, mask: torch.Tensor | None) -> torch.Tensor:
    """`attention.sdpa_attend`, except in bf16-autocast training on the CPU (see the module docstring)."""
    if not _autocast_training(q):
        return sdpa_attend(q, k, v, q_pos, k_pos, chunk, mask)
    if q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] <= SCORES_LIMIT:
        return scores_attention(q, k, v, attention_mask(q_pos, k_pos, chunk) if mask is None else mask)
    with torch.autocast("cpu", enabled=False):  # too long for explicit scores: float32 flash
        return sdpa_attend(q.float(), k.float(), v.float(), q_pos, k_pos, chunk, mask).to(q.dtype)


BY_CHUNKS.add(cpu_autocast_attend)


def _autocast_training(q: torch.Tensor) -> bool:
    """CPU, bf16 autocast, gradients on: where torch's fused attention kernels train slowly."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and torch.is_autocast_enabled("cpu")
            and torch.is_grad_enabled())


def scores_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Attention through an explicit score matrix, in the inputs' dtype. Returns (B, Tq, H, Dh).

    q (B, Tq, H, Dh), k and v (B, Tk, KV, Dh), `allowed` an attention_mask. Used for bf16-autocast
    training on the CPU, where torch 2.13's flash attention trains slowly: its bf16 backward is slow,
    and in float32 its products run at float32 speed (benchmarks/attention_train.py compares them,
    with the output error of each). The query heads
    that share a KV head are stacked along the rows, so K and V are never repeated: one baddbmm (the
    mask enters as its additive term), a softmax and one bmm. Memory grows with Tq * Tk (SCORES_LIMIT).
    """
    B, Tq, H, Dh = q.shape
    Tk, KV = k.shape[1], k.shape[2]
    rep = H // KV
    q = (q * Dh ** -0.5).permute(0, 2, 1, 3).reshape(B * KV, rep * Tq, Dh)  # query head h = kv * rep + r
    k = k.permute(0, 2, 3, 1).reshape(B * KV, Dh, Tk)
    v = v.transpose(1, 2).reshape(B * KV, Tk, Dh)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    if allowed.dim() == 4:  # per-row masks (B, 1, Tq, Tk)
        bias = bias.unsqueeze(2).expand(B, KV, rep, Tq, Tk).reshape(B * KV, rep * Tq, Tk)
    else:
        bias = bias.repeat(rep, 1).expand(B * KV, rep * Tq, Tk)
    probs = torch.softmax(torch.baddbmm(bias, q, k), dim=-1)  # (B * KV, rep * Tq, Tk)
    return (probs @ v).view(B, KV, rep, Tq, Dh).reshape(B, H, Tq, Dh).transpose(1, 2)
