"""Grouped-query attention with Llama 4's two layer kinds.

RoPE layers: rotary positions, weightless QK-norm, and (optionally) chunked local attention, where a
token sees only the earlier tokens of its own fixed block of `chunk` positions.
NoPE layers: no positional embedding, full causal attention, and queries scaled up slowly with their
position ("temperature tuning") so attention stays sharp over very long contexts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..base.config import ModelConfig
from .rope import Rope, apply_rope

# Backends that may be handed a chunked layer's pass as one causal pass per chunk (`by_chunks`): those
# that read the positions only for the causal mask. A backend added from outside (an observer, an
# experiment's) is not in it and sees the whole sequence with its chunk, as it always did.
BY_CHUNKS: set[Callable[..., torch.Tensor]] = set()


def rms_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim with no gain, in float32, cast back: the reference's "L2Norm" of q and k,
    and RMSNorm before its gain."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Boolean mask, True where a query may attend to a key: causal, and the same chunk if chunked.

    Positions are (Tq,)/(Tk,) for one layout shared by the batch, giving (Tq, Tk), or (B, Tq)/(B, Tk)
    for per-row positions (left-padded batches), giving (B, 1, Tq, Tk). A negative position marks a
    padding or empty slot: real queries never see it, and a padding query sees only such slots, so
    that no row is fully masked (which would give NaN).
    """
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    allowed = (k <= q) & (k >= 0)
    if chunk is not None:
        allowed = allowed & (q // chunk == k // chunk)
    allowed = allowed | ((q < 0) & (k < 0))
    return allowed.unsqueeze(-3) if allowed.dim() == 3 else allowed


class Masks:
    """The attention masks of one forward pass, each built once per layer kind: the one place masks are made.

    Within a pass every full-attention layer sees the same key positions, and so does every chunked one (with
    a cache: every append-mode layer, and every ring), so a pass needs at most one mask per kind, keyed by
    (ring, chunk), as the reference models build theirs once in the model's forward. Built on first ask: a
    plain causal pass over a whole sequence (no mask: SDPA's own causal path) or one that goes chunk by
    chunk asks for none. `Transformer.forward` makes one per call and hands it to every layer.
    """

    def __init__(self) -> None:
        self._built: dict[tuple[bool, int | None], torch.Tensor] = {}

    def get(self, q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int | None, ring: bool) -> torch.Tensor:
        """The `attention_mask` of this pass's layers of this kind."""
        key = (ring, chunk)
        if key not in self._built:
            self._built[key] = attention_mask(q_pos, k_pos, chunk)
        return self._built[key]


def numbered_from(positions: torch.Tensor) -> int | None:
    """The first position where positions (T,) are start, start + 1, ..., else None (per-row positions, gaps,
    none at all). Reads them on the host: for positions a caller hands over, not for those the model numbers."""
    if positions.dim() != 1 or not len(positions):
        return None
    start = int(positions[0])
    return start if torch.equal(positions, torch.arange(start, start + len(positions), device=positions.device)) \
        else None


def temperature_scale(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)), float32, the shape of positions."""
    p = positions.to(torch.float32)
    return 1.0 + attn_scale * torch.log1p(torch.floor((p + 1.0) / floor_scale))


class LayerCache:
    """One layer's keys and values for a batch, preallocated, KV heads only (the point of GQA).

    Full-attention layers keep every position (`slots` = the longest sequence). Chunked layers keep
    only the last few (`ModelConfig.cache_slots`): older keys can never be used again, and memory stays
    bounded by the chunk.
    Each slot remembers its position (-1 = empty or padding) so the mask can be built from positions.
    """

    def __init__(self, batch: int, slots: int, kv_heads: int, head_dim: int, window: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.k = torch.zeros(batch, slots, kv_heads, head_dim, dtype=dtype, device=device)  # (B, S, KV, Dh)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((batch, slots), -1, dtype=torch.long, device=device)  # (B, S)
        self.window = window  # True: keep the last `slots` positions (chunked layer); False: append
        self.length = 0  # filled slots (append mode)

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add new keys/values (B, t, KV, Dh) at positions (B, t); return everything attendable now."""
        t = k.shape[1]
        if not self.window:
            s = self.length
            if s + t > self.k.shape[1]:
                raise ValueError(f"KV cache is full ({self.k.shape[1]} positions); allocate a longer cache")
            self.k[:, s:s + t], self.v[:, s:s + t], self.pos[:, s:s + t] = k, v, pos
            self.length = s + t
            return self.k[:, :s + t], self.v[:, :s + t], self.pos[:, :s + t]
        k_all, v_all = torch.cat([self.k, k], 1), torch.cat([self.v, v], 1)
        pos_all = torch.cat([self.pos, pos], 1)
        keep = self.k.shape[1]
        if keep:
            self.k.copy_(k_all[:, -keep:])
            self.v.copy_(v_all[:, -keep:])
            self.pos.copy_(pos_all[:, -keep:])
        return k_all, v_all, pos_all

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held (positions are bookkeeping, not counted)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class KVCache:
    """The per-layer caches of a model for one batch of sequences of at most max_len tokens."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.max_len = max_len
        self.layers = []
        for i in range(cfg.n_layers):
            slots, ring = cfg.cache_slots(i, max_len)
            self.layers.append(LayerCache(batch, slots, cfg.n_kv_heads, cfg.head_dim, ring, dtype, device))

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


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
        self.attend = sdpa_attend  # how scores are computed; `ops.install` may put a faster one here

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                cache: LayerCache | None = None, start: int | None = None, masks: Masks | None = None
                ) -> torch.Tensor:
        """x (B, T, d) at positions (T,) or per row (B, T) -> (B, T, d). `rope`: cos/sin (.., T, Dh/2, 2).

        With a cache, the new keys/values are stored and the queries attend to everything cached.
        `start`: the first position, where the caller knows it (positions = start, start+1, ... and no
        cache); a chunked layer whose pass starts at a chunk boundary then attends chunk by chunk.
        `masks`: the pass's masks, shared by its layers (a new one when the layer is called alone).

        The backend gets no mask exactly when the pass is plain causal (one layout of positions for the
        batch, the keys' the queries', no chunk, two or more of them): SDPA's causal path needs none.
        """
        B, T, _ = x.shape
        H, KV, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, Dh)
        k = self.k_proj(x).view(B, T, KV, Dh)
        v = self.v_proj(x).view(B, T, KV, Dh)
        if self.use_rope:
            qk = apply_rope(torch.cat((q, k), dim=2), rope)  # (B, T, H + KV, Dh): one pass for both
            if self.qk_norm:
                qk = rms_unit(qk, self.eps)
            q, k = qk.split((H, KV), dim=2)
        elif self.temperature:
            scale = temperature_scale(positions, self.floor_scale, self.attn_scale)
            q = (q * scale[..., None, None]).to(q.dtype)
        k_pos, mask = positions, None
        if cache is not None:
            k, v, k_pos = cache.update(k, v, positions.expand(B, T))
        if cache is None and T and goes_by_chunks(self.attend, self.chunk, start):
            out = by_chunks(self.attend, q, k, v, positions, self.chunk)
        else:
            if cache is not None or self.chunk is not None or positions.dim() != 1 or T < 2:
                mask = (masks or Masks()).get(positions, k_pos, self.chunk, cache is not None and cache.window)
            out = self.attend(q, k, v, positions, k_pos, self.chunk, mask)  # (B, T, H, Dh)
        return self.o_proj(out.reshape(B, T, H * Dh))


def goes_by_chunks(attend: Callable[..., torch.Tensor], chunk: int | None, start: int | None) -> bool:
    """Whether a chunked layer's pass over a whole sequence (no cache) numbered from `start` attends chunk by
    chunk (`by_chunks`): it starts at a chunk boundary and its backend is one of BY_CHUNKS. The model and
    explain's recorder (observe.py) decide alike, so an observed pass equals the plain one bit for bit."""
    return chunk is not None and start is not None and start % chunk == 0 and attend in BY_CHUNKS


def by_chunks(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              chunk: int) -> torch.Tensor:
    """A chunked layer's attention over a sequence that starts at a chunk boundary, as a plain causal pass
    per chunk: the whole chunks become rows of their own, (B * n, chunk), and a shorter last one is a call
    of its own. The same attention the chunk mask gives, without the (T, T) mask, most of which is False
    and which the fused kernels cannot skip (and with GQA, CUDA's fused kernels take no mask at all). The
    causal mask is the same in every chunk, so each is passed the first chunk's positions."""
    B, T, H, Dh = q.shape
    n = T // chunk
    whole = n * chunk
    parts = []
    if n:
        def rows(t: torch.Tensor) -> torch.Tensor:
            return t[:, :whole].reshape(B * n, chunk, *t.shape[2:])

        first = positions[:chunk]
        parts.append(attend(rows(q), rows(k), rows(v), first, first, None, None).reshape(B, whole, H, Dh))
    if whole < T:
        last = positions[whole:]
        parts.append(attend(q[:, whole:], k[:, whole:], v[:, whole:], last, last, None, None))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                chunk: int | None, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention of q (B, Tq, H, Dh) over k, v (B, Tk, KV, Dh) -> (B, Tq, H, Dh).

    `mask` is the layer's `Masks.get`; None for a plain causal pass (`Attention.forward` says when), which
    SDPA masks itself. Every backend takes these arguments; one that needs the causal mask written out
    builds it with `attention_mask`, the one rule.
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, Dh)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


BY_CHUNKS.add(sdpa_attend)

