"""The engine's cache manager: one KV cache of `rows` slots, each row a sequence of its own.

A request owns one row from its prefill to its last token; rows advance independently (each at its own
position) and a finished row's slot is reused by the next request. `check_cache_fits` refuses, before
anything is allocated, a cache larger than the memory free for it.
"""

from __future__ import annotations

import torch

from ..base.config import ModelConfig
from ..base.errors import ConfigError
from ..base.runtime import available_memory
from ..model.attention import KVCache, LayerCache


class SlotLayer(LayerCache):
    """One layer's keys and values for `rows` independent sequences: an `attention.LayerCache` whose rows
    each advance on their own.

    Full-attention layers keep position p of a row in slot p. Chunked layers keep a ring
    (`ModelConfig.cache_slots`), position p in slot p mod its length: a query never looks further back
    than the start of its chunk, so the ring always holds every key it may see. Empty slots have position
    -1; the mask is built from positions, so stale keys of a row's previous request are invisible once the
    row is reset.
    """

    def __init__(self, rows: int, slots: int, kv_heads: int, head_dim: int, window: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(rows, slots, kv_heads, head_dim, window, dtype, device)
        self.active = 0  # rows [0, active) take part in the current step
        self.span = 0  # full layers: slots [0, span) hold every position the step needs
        self.slot: torch.Tensor | None = None  # each active row's slot for its new key, flat (row * slots + slot)

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store one new key/value per active row, (n, 1, KV, Dh) at positions (n, 1); return what the
        rows may attend to: keys and values (n, S, KV, Dh) and their positions (n, S)."""
        n, (R, S, KV, Dh) = self.active, self.k.shape
        if self.window:  # what the rows see: the ring before this write, and the new key
            seen = torch.cat([self.k[:n], k], 1), torch.cat([self.v[:n], v], 1), torch.cat([self.pos[:n], pos], 1)
        # one flat index per row, computed once per step for every layer of this shape (`SlotCache.prepare`)
        self.k.view(R * S, KV, Dh).index_copy_(0, self.slot, k[:, 0])
        self.v.view(R * S, KV, Dh).index_copy_(0, self.slot, v[:, 0])
        self.pos.view(R * S).index_copy_(0, self.slot, pos[:, 0])
        if self.window:
            return seen
        return self.k[:n, :self.span], self.v[:n, :self.span], self.pos[:n, :self.span]

    def load(self, row: int, layer: LayerCache, source: int = 0) -> None:
        """Put row `source` of a prefilled layer cache (a KVCache's one row, or a row of another slot cache)
        into `row`, forgetting what the row held."""
        self.pos[row] = -1
        keep = layer.pos[source] >= 0
        p = layer.pos[source][keep]
        slot = p % self.k.shape[1] if self.window else p
        self.k[row, slot], self.v[row, slot], self.pos[row, slot] = layer.k[source][keep], layer.v[source][keep], p

    def move(self, src: int, dst: int) -> None:
        self.k[dst], self.v[dst], self.pos[dst] = self.k[src], self.v[src], self.pos[src]


class SlotCache:
    """The per-layer slot caches of a model: `rows` sequences of up to `context` tokens, each its own."""

    def __init__(self, cfg: ModelConfig, rows: int, dtype: torch.dtype, device: torch.device,
                 context: int | None = None) -> None:
        self.context = context or cfg.max_seq_len  # positions 0..context-1
        self.layers = [SlotLayer(rows, slots, cfg.n_kv_heads, cfg.head_dim, window, dtype, device)
                       for slots, window in self.shapes(cfg, self.context)]

    @staticmethod
    def shapes(cfg: ModelConfig, context: int) -> list[tuple[int, bool]]:
        """(slots, ring or not) per layer (`ModelConfig.cache_slots`)."""
        return [cfg.cache_slots(i, context) for i in range(cfg.n_layers)]

    @classmethod
    def nbytes(cls, cfg: ModelConfig, rows: int, dtype: torch.dtype, context: int) -> int:
        """The bytes the cache takes: keys and values in `dtype`, and a position (int64) per slot."""
        per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize + 8
        return rows * per_slot * sum(slots for slots, _ in cls.shapes(cfg, context))

    def prepare(self, positions: list[int]) -> None:
        """The next step runs rows [0, len(positions)), each at its position: each layer's flat slot for every
        row's new key (full layers: the position; rings: the position modulo the ring), one index tensor
        per slot count, built from the host's numbers in one op."""
        active, span = len(positions), max(positions) + 1
        slots: dict[tuple[int, bool], torch.Tensor] = {}
        for layer in self.layers:
            S = layer.k.shape[1]
            if (S, layer.window) not in slots:
                flat = [b * S + (p % S if layer.window else p) for b, p in enumerate(positions)]
                slots[S, layer.window] = torch.tensor(flat, device=layer.k.device)
            layer.active, layer.span, layer.slot = active, span, slots[S, layer.window]

    def load(self, row: int, cache: KVCache | SlotCache, source: int = 0) -> None:
        """Copy row `source` of `cache` (a prompt's prefill) into `row`."""
        for mine, theirs in zip(self.layers, cache.layers, strict=True):
            mine.load(row, theirs, source)

    def move(self, src: int, dst: int) -> None:
        for layer in self.layers:
            layer.move(src, dst)

    def clear(self, row: int) -> None:
        """Forget what `row` holds (its slots become empty)."""
        for layer in self.layers:
            layer.pos[row] = -1


def check_cache_fits(cfg: ModelConfig, rows: int, dtype: torch.dtype, device: torch.device, context: int) -> None:
    """Refuse, in one line saying what fits, a slot cache larger than the memory free for it (on the CPU:
    what the machine has available; on a GPU: its free memory), before allocating any of it."""
    need = SlotCache.nbytes(cfg, rows, dtype, context)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    if free is None or need <= CACHE_SHARE * free:
        return
    per_token = SlotCache.nbytes(cfg, rows, dtype, context + 1) - need or 1
    fits = max(0, int((CACHE_SHARE * free - SlotCache.nbytes(cfg, rows, dtype, 1)) // per_token) + 1)
    raise ConfigError(f"the KV cache for {rows} rows of {context:,} tokens needs {need / 2**30:,.1f} GiB and "
                      f"{free / 2**30:,.1f} GiB is free; pass --max-context {fits:,} or less (or a smaller "
                      "--max-batch)" if fits else f"the KV cache for {rows} rows needs more than the "
                      f"{free / 2**30:,.1f} GiB free even for a short context; pass a smaller --max-batch")


CACHE_SHARE = 0.8  # of the free memory, at most, for the slot cache (the model's activations need the rest)


def held(layer: LayerCache, row: int) -> int:
    """Positions a layer's cache holds for one row (a chunked layer: at most chunk - 1)."""
    return int((layer.pos[row] >= 0).sum())
