"""Decode steps replayed as CUDA graphs: a step's hundreds of kernel launches recorded once per batch size and
replayed with one call, so that a GPU's decoding is not bound by the host launching them.

A graph replays the same kernels on the same memory, so everything a step reads or writes must stay where
it was at capture and have the same shape: the tokens, positions and cache slots go into static buffers
(`StaticStep`) before each replay, the rows are padded up to the graph's batch size (`BUCKETS`; a padded
row writes into a free row of the cache, which the next request that takes the row clears first), full
layers attend over the whole context (empty slots are masked by position, as always), and the routed
experts take the paths a graph can hold (`ops.decode.static_shapes`: gathered experts, or every expert
on every row, no host reads). Off CUDA the same static step runs without a graph: the CPU tests check
that it computes the plain step's logits, which is what a capture records.
"""

from __future__ import annotations

import logging

import torch

from ..model.transformer import Transformer
from ..ops.decode import EVERY_EXPERT_ROWS, static_shapes
from .cache import SlotCache

log = logging.getLogger("nanollama4.engine")

BUCKETS = (1, 2, 4, 8, EVERY_EXPERT_ROWS)  # batch sizes with a graph of their own; rows are padded up to one


def graphable(model: Transformer, rows: int) -> bool:
    """Whether a decode step of `rows` rows keeps static shapes and reads nothing back: up to the last bucket,
    where the routed experts are gathered or all run on every row (`FastExperts.forward` under
    `static_shapes`); not where capacity at inference makes rows compete (it drops rows by their values)."""
    return rows <= BUCKETS[-1] and not model.cfg.capacity_at_inference


class StaticStep:
    """The decode step of `model` over `cache` with static shapes, one per batch size, captured as a CUDA graph
    on CUDA (at its first call) and called directly elsewhere."""

    def __init__(self, model: Transformer, cache: SlotCache) -> None:
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.rows = cache.layers[0].k.shape[0]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, dict[str, torch.Tensor]]] = {}

    def bucket(self, rows: int) -> int:
        return min(next(b for b in BUCKETS if b >= rows), self.rows)

    def __call__(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        n = len(tokens)
        b = self.bucket(n)
        graph, io = self.graphs.get(b) or self._build(b)
        pad = b - n
        ids = torch.tensor([*tokens, *[0] * pad], dtype=torch.long)
        pos = torch.tensor([*positions, *[0] * pad], dtype=torch.long)
        io["ids"].copy_(ids[:, None], non_blocking=True)
        io["positions"].copy_(pos[:, None], non_blocking=True)
        for (S, window), slot in io["slots"].items():
            flat = torch.arange(b) * S + (pos % S if window else pos)
            slot.copy_(flat, non_blocking=True)
        if graph is None:
            io["logits"] = self._forward(io)
        else:
            graph.replay()
        return io["logits"][:n].clone()  # (the next replay overwrites the buffer)

    def _forward(self, io: dict) -> torch.Tensor:
        """The step itself, on the static buffers: what a capture records."""
        for layer in self.cache.layers:
            layer.active, layer.span, layer.slot = io["bucket"], self.cache.context, io["slots"][layer.k.shape[1],
                                                                                                 layer.window]
        with static_shapes():
            return self.model(io["ids"], cache=self.cache, positions=io["positions"], last_only=True)[:, -1]

    def _build(self, b: int) -> tuple[torch.cuda.CUDAGraph | None, dict]:
        """The static buffers of batch size b, and on CUDA its graph, captured after warm-up steps on a side
        stream (allocations a capture may not make happen there first)."""
        dev = self.device
        io: dict = {"bucket": b, "ids": torch.zeros(b, 1, dtype=torch.long, device=dev),
                    "positions": torch.zeros(b, 1, dtype=torch.long, device=dev),
                    "slots": {(layer.k.shape[1], layer.window): torch.zeros(b, dtype=torch.long, device=dev)
                              for layer in self.cache.layers}}
        graph = None
        if dev.type == "cuda":
            # warm-up and capture write keys at position 0 of rows 0..b-1: the cache is saved and put back
            saved = [(layer.k.clone(), layer.v.clone(), layer.pos.clone()) for layer in self.cache.layers]
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(io)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                io["logits"] = self._forward(io)
            for layer, (k, v, pos) in zip(self.cache.layers, saved, strict=True):
                layer.k.copy_(k)
                layer.v.copy_(v)
                layer.pos.copy_(pos)
            log.info("decode steps of %d rows: captured as a CUDA graph", b)
        self.graphs[b] = graph, io
        return graph, io
