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

MaskMemo = dict[tuple[bool, int | None], torch.Tensor]  # (window, chunk) -> this step's mask
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
                 dtype: torch.dtype, device: torch.device | str, masks: MaskMemo | None = None) -> None:
        self.k = torch.zeros(batch, slots, kv_heads, head_dim, dtype=dtype, device=device)  # (B, S, KV, Dh)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((batch, slots), -1, dtype=torch.long, device=device)  # (B, S)
        self.window = window  # True: keep the last `slots` positions (chunked layer); False: append
        self.length = 0  # filled slots (append mode)
        self.masks = masks  # shared by a KVCache's layers and cleared each step; None = no memo

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int | None) -> torch.Tensor:
        """attention_mask for this step, built once per step for all layers of the same kind.

        Within one forward pass every append-mode layer holds the same positions, and so does every
        windowed layer, so the mask depends only on (window, chunk); decoding saves a dozen small ops
        per layer and token.
        """
        key = (self.window, chunk)
        if self.masks is None or torch.compiler.is_compiling():  # a compiled graph shares the work itself
            return attention_mask(q_pos, k_pos, chunk)
        if key not in self.masks:
            self.masks[key] = attention_mask(q_pos, k_pos, chunk)
        return self.masks[key]

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
        self.masks: MaskMemo = {}
        self.layers = []
        for i in range(cfg.n_layers):
            slots, ring = cfg.cache_slots(i, max_len)
            self.layers.append(LayerCache(batch, slots, cfg.n_kv_heads, cfg.head_dim, ring, dtype, device,
                                          self.masks))

    def new_step(self) -> None:
        """Forget the masks of the previous forward pass. `Transformer.forward` calls this at its start;
        code that drives the layers itself must call it before each step."""
        self.masks.clear()

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
                cache: LayerCache | None = None, start: int | None = None) -> torch.Tensor:
        """x (B, T, d) at positions (T,) or per row (B, T) -> (B, T, d). `rope`: cos/sin (.., T, Dh/2, 2).

        With a cache, the new keys/values are stored and the queries attend to everything cached.
        `start`: the first position, where the caller knows it (positions = start, start+1, ... and no
        cache); a chunked layer whose pass starts at a chunk boundary then attends chunk by chunk.
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
            mask = cache.mask(positions, k_pos, self.chunk)
        if cache is None and T and goes_by_chunks(self.attend, self.chunk, start):
            out = by_chunks(self.attend, q, k, v, positions, self.chunk)
        else:
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

    `mask` (an attention_mask) is built from the positions when not given; a plain causal, unchunked pass
    over a whole sequence needs none.
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, Dh)
    plain_causal = q_pos.dim() == 1 and k_pos.dim() == 1 and q_pos.shape == k_pos.shape
    if mask is None and chunk is None and plain_causal and q.shape[-2] > 1:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        if mask is None:
            mask = attention_mask(q_pos, k_pos, chunk)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


BY_CHUNKS.add(sdpa_attend)

