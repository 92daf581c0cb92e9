"""The engine's runner: the model's forward passes for a prefill and for one batched decode step.

A prefill feeds one prompt into a fresh one-row cache (or, through the C++ step, the prompts that go in
whole at one step into the rows of one cache, in one call). A decode step feeds every active row's newest
token at its own position, attending to the row's slots of the shared `SlotCache`. Four ways compute a
decode step: the plain model (the reference), the C++ step (`ops.fastdecode`: the same math in one call,
several times faster on a CPU where the plain step is bound by its count of operations), on CUDA the
step replayed as a CUDA graph (`engine.graphs`: the default there, where shapes stay static), and with
`compile` torch.compile where it stays one graph.

Which is faster, and with how many threads, depends on the machine: splitting each of a step's small
operations over several threads can cost more than it saves. So the runner times its own first steps of
each size with each way it may take (the C++ step and the plain one, one thread and all) and keeps the
fastest for that size (`Runner.choice`): no extra work, the trial steps are the real ones, and a way that
is already far slower than another is dropped after one timed step. Compiled steps keep the process's
thread count (a graph is specialised to it).
"""

from __future__ import annotations

import functools
import itertools
import logging
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.attention import KVCache
from ..model.transformer import Transformer
from ..ops import fastdecode
from ..ops.decode import EVERY_EXPERT_ROWS, few_assignments
from .cache import SlotCache
from .graphs import StaticStep, graphable

log = logging.getLogger("nanollama4.engine")

TRIAL_STEPS = 4  # timed steps per way (C++ or plain, threads) before a size's choice is made
FAR_SLOWER = 1.5  # a way whose best timed step is this much slower than another's is dropped
Way = tuple[str, int]  # ("fast" or "plain", threads)
FAST_PREFILL_TOKENS = 256  # longer prompts are prefilled by the plain model (its attention is the faster there)
TOGETHER_TOKENS = FAST_PREFILL_TOKENS  # the most prompt tokens one call of the C++ step prefills together
_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(size, threads): way}


@dataclass
class FastPrefill:
    """A prompt's row of a slot cache and the C++ step over that cache. Prompts prefilled together share one
    cache, a row each (`Runner.prefill_together`); `Runner.seat` copies the row into the engine's."""

    cache: SlotCache
    step: fastdecode.FastStep
    row: int = 0


Prefill = KVCache | FastPrefill  # a prompt's cache while it goes in: the runner's to make, fill and seat


class Runner:
    """Runs `model` over `cache` (the slot cache of the engine's rows)."""

    only: str | None = None  # "fast", "plain" or "graph": decode that way alone (tests and benchmarks set it)

    def __init__(self, model: Transformer, cache: SlotCache, compile: bool = False) -> None:
        self.model, self.cache, self.compile = model, cache, compile
        self.device = next(model.parameters()).device
        # (decode size (rows rounded up to a power of two), threads) -> the way chosen; shared by the runners of
        # one model (one engine per `generate` call), so that a process measures once
        self.choice: dict[tuple, Way] = _CHOICES.setdefault(model, {})
        self._trials: dict[tuple, dict[Way, list[float]]] = {}
        self._fast: fastdecode.FastStep | None | bool = None  # built at the first decode step; False: cannot
        self.graphs = self.device.type == "cuda" and not compile  # CUDA: decode steps replayed as graphs
        self._static = StaticStep(model, cache)
        self._hooks, self._parts = fastdecode.hook_tables(model), [(b.attn, b.ffn) for b in model.blocks]

    def prefill_cache(self, tokens: int, plain: bool = False) -> Prefill:
        """A one-row cache for a prompt of `tokens` tokens: for the C++ step (`FastPrefill`) where it decodes one
        row here and the prompt is short enough for its attention loops, else the plain model's KVCache."""
        cfg, dtype = self.model.cfg, next(self.model.parameters()).dtype
        if not plain and self._fast_prefills(tokens, tokens):
            return self._fast_cache(1, tokens)[0]
        return KVCache(cfg, 1, tokens, dtype=dtype, device=self.device)

    def _fast_cache(self, rows: int, context: int) -> list[FastPrefill]:
        """A new slot cache of `rows` rows for positions below `context` and the C++ step over it, a
        FastPrefill per row."""
        cache = SlotCache(self.model.cfg, rows, next(self.model.parameters()).dtype, self.device, context)
        step = fastdecode.FastStep(self.model, cache.layers, context, checked=True)
        return [FastPrefill(cache, step, row) for row in range(rows)]

    def _fast_prefills(self, longest: int, tokens: int) -> bool:
        """Whether the C++ step prefills prompts of at most `longest` and `tokens` in all: it decodes one row
        here, the prompts are short enough for its attention loops, and no capacity makes their tokens compete."""
        fast = None if longest > FAST_PREFILL_TOKENS or self.only == "plain" else self.fast_step()
        chosen = self.choice.get((1, torch.get_num_threads()), ("fast", 0))[0]
        return fast is not None and fast.usable(tokens) and chosen == "fast"

    def groups(self, prompts: list[list[int]]) -> list[list[int]]:
        """The indices of `prompts` in the groups `prefill_together` takes, in order: runs of up to
        `TOGETHER_TOKENS` tokens in all, which bounds a call's buffers (some are per thread) to one long prompt's.
        A group of one is left out: alone, a prompt goes in as any other."""
        groups: list[list[int]] = [[]]
        size = 0  # the last group's tokens
        for i, prompt in enumerate(prompts):
            if groups[-1] and size + len(prompt) > TOGETHER_TOKENS:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += len(prompt)
        return [g for g in groups if len(g) > 1]

    def prefill_together(self, prompts: list[list[int]]) -> tuple[list[FastPrefill], torch.Tensor] | None:
        """Whole prompts (one of `groups`) through the C++ step in one call, each in its row of one new slot
        cache: each prompt's cache and the logits of its last token (prompts, vocab); None where the step would
        not prefill them (`prefill_cache` then gives each its own). One call shares the products' weights among
        all the prompts' tokens, where a call per prompt reads them again for each."""
        longest = max(map(len, prompts))
        if not self._fast_prefills(longest, sum(map(len, prompts))):
            return None
        caches = self._fast_cache(len(prompts), longest)
        logits = caches[0].step([t for p in prompts for t in p], [i for p in prompts for i in range(len(p))],
                                [row for row, p in enumerate(prompts) for _ in p])
        last = torch.tensor(list(itertools.accumulate(map(len, prompts)))) - 1
        return caches, logits[last]

    def seat(self, row: int, cache: Prefill) -> None:
        """Copy a prompt's whole prefill into the engine's `row`."""
        if isinstance(cache, FastPrefill):
            self.cache.load(row, cache.cache, cache.row)
        else:
            self.cache.load(row, cache)

    def prefill(self, ids: torch.Tensor, cache: Prefill, start: int = 0, last_only: bool = True,
                head: bool = True) -> torch.Tensor:
        """Logits (1, T or 1, vocab) of one prompt's tokens ids (1, T) at positions start..start+T-1, their keys
        into `cache` (which holds positions 0..start-1 already); `head=False`: only the cache is wanted."""
        T = ids.shape[1]
        if isinstance(cache, FastPrefill):
            logits = cache.step(ids[0].tolist(), list(range(start, start + T)), [cache.row] * T)
            return (logits[-1:] if last_only else logits)[None]
        positions = torch.arange(start, start + T, device=ids.device)[None]
        return self.model(ids, cache=cache, positions=positions, last_only=last_only, head=head)

    def fast_step(self) -> fastdecode.FastStep | None:
        """The C++ step over this runner's model and cache, or None where it cannot run (the reason logged once)."""
        if self._fast is None:
            reason = "compile=True asks for torch.compile" if self.compile else fastdecode.unsupported(self.model)
            try:
                self._fast = fastdecode.FastStep(self.model, self.cache.layers, self.cache.context) \
                    if reason is None else False
            except (ValueError, RuntimeError) as e:
                reason, self._fast = str(e), False
            if reason is not None:
                log.info("decoding takes the plain path: %s", reason)
        return self._fast or None

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits (rows, vocab) of each row's newest token at its position."""
        rows = len(tokens)
        if self._graphs_apply(rows):
            try:
                return self._static(tokens, positions)
            except Exception:  # a capture this device or model cannot make: decode as before, say why once
                log.exception("decoding without CUDA graphs from now on: capturing a step failed")
                self.graphs = False
        fast = self.fast_step() if self.device.type == "cpu" else None
        fast = fast if fast is not None and fast.usable(rows) else None
        most = torch.get_num_threads()
        ways = [w for w in (("fast", most), ("fast", 1), ("plain", most), ("plain", 1))
                if (w[0] == "plain" or fast is not None) and self.only in (None, w[0])]
        ways = list(dict.fromkeys(ways)) or [("plain", most)]  # (only="fast" where it cannot run: plain)
        size = 1 << (rows - 1).bit_length()
        key = (size, most) if self.only is None else (size, most, self.only)  # (a choice among all ways, or some)
        way, trial = self.choice.get(key), None
        if way is None and len(ways) > 1 and not self.compile:
            trial = self._trials.setdefault(key, {w: [] for w in ways})
            alive = [w for w in ways if w in trial]
            way = min(alive, key=lambda w: len(trial[w])) if alive else None  # the way tried least so far
        if way not in ways:  # the chosen way cannot run this step (the model is being watched): the first that can
            way, trial = ways[0], None
        if way[0] == "fast":
            step = functools.partial(fast, tokens, positions)
        else:
            step = functools.partial(self._plain, tokens, positions)
        if trial is None and way[1] == most:
            return step()
        torch.set_num_threads(way[1])
        try:
            t = time.perf_counter()
            logits = step()
            elapsed = time.perf_counter() - t
        finally:
            torch.set_num_threads(most)
        if trial is not None:
            self._note(key, trial, way, elapsed)
        return logits

    def _graphs_apply(self, rows: int) -> bool:
        """Whether this step replays a graph: on CUDA (or where `only` asks for it: the CPU dry run), at a size
        that keeps static shapes, with nothing watching the modules."""
        wanted = self.only == "graph" or (self.graphs and self.only is None)
        return wanted and graphable(self.model, rows) and not fastdecode.watched(self.model, self._hooks, self._parts)

    def _note(self, key: tuple, trial: dict[Way, list[float]], way: Way, elapsed: float) -> None:
        """Record a trial step's time; drop ways far slower than another; choose once the rest are all timed."""
        trial[way].append(elapsed)
        timed = [min(t[1:]) for t in trial.values() if len(t) > 1]  # each way's first step warms it up
        if timed:  # a way far slower than another's best, even in its warm-up step, is tried no more
            for w, times in list(trial.items()):
                if min(times) > FAR_SLOWER * min(timed):
                    del trial[w]
        if trial and all(len(t) > TRIAL_STEPS for t in trial.values()):
            self.choice[key] = way = min(trial, key=lambda w: statistics.median(trial[w][1:]))
            log.info("decode steps of up to %d rows: %s path, %d thread(s)", key[0], *way)

    def _plain(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """The model's own forward pass (compiled where `compile` asks and the step stays one graph)."""
        rows = len(tokens)
        self.cache.prepare(positions)
        ids = torch.tensor(tokens, device=self.device)[:, None]
        pos = torch.tensor(positions, device=self.device)[:, None]
        compiled = self.compile and compiles_well(self.model, rows)
        forward = compiled_decoder(self.model) if compiled else self.model
        return forward(ids, cache=self.cache, positions=pos, last_only=True)[:, -1]


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
        # the demo model at batch 1 (measured 2026-12-03, see git history of benchmarks/RESULTS.md);
        # freezing the weights measured slower, so not
        _compiled_forward = torch.compile(Transformer.forward, dynamic=True, options={"cpp_wrapper": True})
    return functools.partial(_compiled_forward, model)


def compiles_well(model: Transformer, batch: int) -> bool:
    """Whether a decode step of this batch stays one graph: up to one assignment per expert the chosen
    experts are gathered on the graph, and up to `EVERY_EXPERT_ROWS` rows every expert runs on every row
    (`ops.decode.every_expert`); larger MoE batches decode eagerly."""
    cfg = model.cfg
    return cfg.n_experts == 0 or batch * cfg.experts_per_token <= few_assignments(cfg.n_experts, compiling=True) \
        or batch <= EVERY_EXPERT_ROWS
