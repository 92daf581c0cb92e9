"""The engine's runner: the model's forward passes for a prefill and for one batched decode step.

A prefill feeds one prompt into a fresh one-row cache. A decode step feeds every active row's newest
token at its own position, attending to the row's slots of the shared `SlotCache`; with `compile`, that
step runs through torch.compile where it stays one graph.

On the CPU a decode step of a few rows is hundreds of small operations, and splitting each over several
threads can cost more than it saves (each parallel region wakes and joins the other threads). So the
runner times its own first steps of each size with one thread and with all, alternately, and keeps the
faster for that size (`Runner.threads`): no extra work, the trial steps are the real ones. Compiled steps
keep the process's thread count (a graph is specialised to it).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from ..attention import KVCache
from ..model import Transformer
from ..ops.decode import EVERY_EXPERT_ROWS, few_assignments
from .cache import SlotCache

TRIAL_STEPS = 4  # timed steps per thread count before a size's choice is made


class Runner:
    """Runs `model` over `cache` (the slot cache of the engine's rows)."""

    def __init__(self, model: Transformer, cache: SlotCache, compile: bool = False) -> None:
        self.model, self.cache, self.compile = model, cache, compile
        self.device = next(model.parameters()).device
        self.threads: dict[int, int] = {}  # decode size (rows rounded up to a power of two) -> threads chosen
        self._trials: dict[int, dict[int, list[float]]] = {}

    def prefill(self, ids: torch.Tensor, cache: KVCache, start: int = 0, last_only: bool = True,
                head: bool = True) -> torch.Tensor:
        """Logits (1, T or 1, vocab) of one prompt's tokens ids (1, T) at positions start..start+T-1, their keys
        into `cache` (which holds positions 0..start-1 already); `head=False`: only the cache is wanted."""
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        return self.model(ids, cache=cache, positions=positions, last_only=last_only, head=head)

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits (rows, vocab) of each row's newest token at its position."""
        rows = len(tokens)
        self.cache.prepare(positions)
        ids = torch.tensor(tokens, device=self.device)[:, None]
        positions = torch.tensor(positions, device=self.device)[:, None]
        compiled = self.compile and compiles_well(self.model, rows)
        forward = compiled_decoder(self.model) if compiled else self.model
        step = functools.partial(forward, ids, cache=self.cache, positions=positions, last_only=True)
        most = torch.get_num_threads()
        size = 1 << (rows - 1).bit_length()
        chosen = self.threads.get(size)
        # a compiled graph is specialised to the thread count: changing it would compile another
        if self.device.type != "cpu" or most == 1 or chosen == most or compiled:
            return step()[:, -1]
        trial = None if chosen else self._trials.setdefault(size, {1: [], most: []})
        n = chosen or min(trial, key=lambda k: len(trial[k]))  # while trying: the count tried less so far
        torch.set_num_threads(n)
        try:
            t = time.perf_counter()
            logits = step()
            elapsed = time.perf_counter() - t
        finally:
            torch.set_num_threads(most)
        if trial is not None:
            trial[n].append(elapsed)
            if all(len(times) > TRIAL_STEPS for times in trial.values()):  # the first of each warms up
                self.threads[size] = min(trial, key=lambda k: statistics.median(trial[k][1:]))
        return logits[:, -1]


_compiled_forward: Callable[..., torch.Tensor] | None = None


def compiled_decoder(model: Transformer) -> Callable[..., torch.Tensor]:
    """model's forward through torch.compile with dynamic shapes: one compiled function for all models.

    Dynamic shapes let one graph serve every cache length, so decoding does not recompile at each step
    (batch size 1 and each model/dtype get graphs of their own). The model code avoids graph breaks on
    this path as long as batch x experts_per_token <= n_experts (MoE experts gathered on the graph, no
    host reads) or the batch has at most 16 rows (every expert on every row); larger batches decode
    eagerly. The compiled function is of the class's forward, bound here, so it keeps no model alive.
    """
    global _compiled_forward
    if _compiled_forward is None:
        # inductor's C++ wrapper calls the generated kernels from C++ rather than Python: +11% tokens/s on
        # the demo model at batch 1 (benchmarks/RESULTS.md); freezing the weights measured slower, so not
        _compiled_forward = torch.compile(Transformer.forward, dynamic=True, options={"cpp_wrapper": True})
    return functools.partial(_compiled_forward, model)


def compiles_well(model: Transformer, batch: int) -> bool:
    """Whether a decode step of this batch stays one graph: up to one assignment per expert the chosen
    experts are gathered on the graph, and up to `EVERY_EXPERT_ROWS` rows every expert runs on every row
    (`ops.decode.every_expert`); larger MoE batches decode eagerly."""
    cfg = model.cfg
    return cfg.n_experts == 0 or batch * cfg.experts_per_token <= few_assignments(cfg.n_experts, compiling=True) \
        or batch <= EVERY_EXPERT_ROWS
