"""Continuous batching: every request in flight decodes in one batched forward pass per step.

A request owns one row of a shared KV cache (`SlotCache`) from its prefill to its last token. Each step
of the engine's loop:
  1. drops the rows whose client went away, and admits waiting requests into free rows: each new
     prompt is prefilled alone, exactly as offline `generate` prefills it, its cache copied into the row;
  2. feeds every row's newest token through the model at once, each row at its own position;
  3. samples each row's next token with the row's own settings and generator, and retires the rows
     that are done (a stop string, max_tokens), moving the last row into the gap.
Rows never see each other: attention is masked per row by position, and the dropless MoE routes
each token alone, so a request's tokens are those offline `generate` gives with the same seed, whatever
else is decoding (up to float rounding of differently shaped products; the tests check token equality).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..attention import KVCache, LayerCache, MaskMemo
from ..config import ModelConfig
from ..errors import ConfigError, Nanollama4Error
from ..explain.tracing import describe_slots, observe
from ..generation import GREEDY_BELOW, Sampling, TextStream, next_token
from ..model import Transformer
from ..runtime import available_memory
from ..tokenizer import Tokenizer, token_bytes, token_label

log = logging.getLogger("nanollama4.serve")
TOP_ODDS = 8  # next tokens a traced step lists
ATTENTION_FLOOR = 0.002  # a traced step lists the keys a token attended to with at least this probability


class QueueFull(Nanollama4Error):
    """More requests are waiting than --max-queue allows; the client should retry later."""


class Closing(Nanollama4Error):
    """The server is shutting down and takes no new requests."""


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class TokenEvent:
    """One new token of a request."""

    token_id: int
    text: str  # the text that became safe to show with this token (held back near a possible stop string)
    logprob: float | None = None  # log-probability of the token under the model (temperature 1, unfiltered)
    top: list[tuple[int, float]] | None = None  # the most likely tokens and their log-probabilities
    trace: dict | None = None  # with Request.trace: the step that chose this token (see Engine._step_trace)


@dataclass
class Finished:
    """A request is over: the last of its events."""

    reason: str  # "stop" (a stop string), "length" (max_tokens), "cancelled" or "error"
    text: str  # text still held back, now safe to show
    prompt_tokens: int
    completion_tokens: int
    prompt_logprobs: list[float | None] | None = None  # with Request.prompt_logprobs: each prompt token's
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    error: str | None = None


Event = TokenEvent | Finished
_ids = itertools.count(1)


@dataclass(eq=False)  # a request is itself: two with equal fields are still two rows
class Request:
    """One prompt to continue. `emit` is called from the engine's thread with each event, in order.
    max_tokens 0 only scores the prompt (with prompt_logprobs) and ends."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    emit: Callable[[Event], None]
    logprobs: int | None = None  # None: no log-probabilities; n: the chosen token's and the n most likely
    prompt_logprobs: bool = False  # also score the prompt's own tokens (echo with logprobs)
    trace: bool = False  # attach each step's routes, attention and odds to its token
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cancelled: bool = False  # set from any thread; the engine drops the row at its next step
    # the engine's own state
    generator: torch.Generator | None = field(default=None, repr=False)
    text: TextStream | None = field(default=None, repr=False)
    generated: int = 0
    position: int = 0  # where the newest token goes
    last: int = 0  # the newest token, fed at the next step
    finished: bool = False
    prompt_scores: tuple = (None, None)  # with prompt_logprobs: each prompt token's and the top ones
    started: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled = True


# ---------------------------------------------------------------------------------------------- the cache
class SlotLayer(LayerCache):
    """One layer's keys and values for `rows` independent sequences: an `attention.LayerCache` whose rows
    each advance on their own (the mask memo, built from positions, is the parent's).

    Full-attention layers keep position p of a row in slot p. Chunked layers keep a ring of chunk - 1
    slots, position p in slot p mod (chunk - 1): a query never looks further back than the start of its
    chunk, so the ring always holds every key it may see. Empty slots have position -1; the mask is
    built from positions, so stale keys of a row's previous request are invisible once the row is reset.
    """

    def __init__(self, rows: int, slots: int, kv_heads: int, head_dim: int, window: bool, dtype: torch.dtype,
                 device: torch.device, masks: MaskMemo) -> None:
        super().__init__(rows, slots, kv_heads, head_dim, window, dtype, device, masks)
        self.active = 0  # rows [0, active) take part in the current step
        self.span = 0  # full layers: slots [0, span) hold every position the step needs

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store one new key/value per active row, (n, 1, KV, Dh) at positions (n, 1); return what the
        rows may attend to: keys and values (n, S, KV, Dh) and their positions (n, S)."""
        n = self.active
        rows, p = torch.arange(n, device=pos.device), pos[:, 0]
        if not self.window:
            self.k[rows, p], self.v[rows, p], self.pos[rows, p] = k[:, 0], v[:, 0], p
            return self.k[:n, :self.span], self.v[:n, :self.span], self.pos[:n, :self.span]
        k_all, v_all = torch.cat([self.k[:n], k], 1), torch.cat([self.v[:n], v], 1)
        pos_all = torch.cat([self.pos[:n], pos], 1)
        slot = p % self.k.shape[1]
        self.k[rows, slot], self.v[rows, slot], self.pos[rows, slot] = k[:, 0], v[:, 0], p
        return k_all, v_all, pos_all

    def load(self, row: int, layer) -> None:
        """Put a prefilled one-sequence `attention.LayerCache` into `row`, forgetting what the row held."""
        self.pos[row] = -1
        keep = layer.pos[0] >= 0
        p = layer.pos[0][keep]
        slot = p % self.k.shape[1] if self.window else p
        self.k[row, slot], self.v[row, slot], self.pos[row, slot] = layer.k[0][keep], layer.v[0][keep], p

    def move(self, src: int, dst: int) -> None:
        self.k[dst], self.v[dst], self.pos[dst] = self.k[src], self.v[src], self.pos[src]


class SlotCache:
    """The per-layer slot caches of a model: `rows` sequences of up to `context` tokens, each its own."""

    def __init__(self, cfg: ModelConfig, rows: int, dtype: torch.dtype, device: torch.device,
                 context: int | None = None) -> None:
        self.masks: MaskMemo = {}
        self.layers = [SlotLayer(rows, slots, cfg.n_kv_heads, cfg.head_dim, window, dtype, device, self.masks)
                       for slots, window in self.shapes(cfg, context or cfg.max_seq_len)]

    @staticmethod
    def shapes(cfg: ModelConfig, context: int) -> list[tuple[int, bool]]:
        """(slots, ring or not) per layer: chunked layers keep a ring of chunk - 1 slots, the others one slot
        per position of the context."""
        out = []
        for i in range(cfg.n_layers):
            chunk = cfg.chunk_size(i)
            window = chunk is not None and chunk - 1 < context
            out.append((chunk - 1 if window else context, window))
        return out

    @classmethod
    def nbytes(cls, cfg: ModelConfig, rows: int, dtype: torch.dtype, context: int) -> int:
        """The bytes the cache takes: keys and values in `dtype`, and a position (int64) per slot."""
        per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize + 8
        return rows * per_slot * sum(slots for slots, _ in cls.shapes(cfg, context))

    def new_step(self) -> None:
        self.masks.clear()

    def prepare(self, active: int, span: int) -> None:
        """The next step runs rows [0, active), whose newest positions are all below `span`."""
        for layer in self.layers:
            layer.active, layer.span = active, span

    def load(self, row: int, cache: KVCache) -> None:
        for mine, theirs in zip(self.layers, cache.layers, strict=True):
            mine.load(row, theirs)

    def move(self, src: int, dst: int) -> None:
        for layer in self.layers:
            layer.move(src, dst)


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


# ---------------------------------------------------------------------------------------------- the engine
class Engine:
    """The model, its slot cache and the loop that decodes every admitted request together, on a thread
    of its own. `submit` from any thread; events come back through each request's `emit`."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, max_batch: int = 16, max_queue: int = 64,
                 max_context: int | None = None) -> None:
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch ({max_batch}) must be >= 1 and max_queue ({max_queue}) >= 0")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.cfg = model.cfg
        self.max_batch, self.max_queue = max_batch, max_queue
        self.context = min(self.cfg.max_seq_len, max_context or self.cfg.max_seq_len)  # prompt + answer, at most
        self.vocab = min(self.cfg.vocab_size, tokenizer.vocab_size)  # the ids that can be sampled and shown
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        check_cache_fits(self.cfg, max_batch, self.dtype, self.device, self.context)
        self.cache = SlotCache(self.cfg, max_batch, self.dtype, self.device, self.context)
        self.rows: list[Request] = []  # request i decodes in cache row i
        self.waiting: deque[Request] = deque()
        self._lock = threading.Condition()
        self._closing = False
        self._admitting: list[Request] = []  # taken from `waiting`, not yet in a row
        self._thread = threading.Thread(target=self._loop, name="nanollama4-engine", daemon=True)
        self.steps = 0  # batched decode steps run
        self.finished: Counter[str] = Counter()  # requests ended, by reason
        self.token_text = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
        # what the API names each token (`bytes:\\xNN` for a piece of a character) and its bytes
        self.token_bytes = [token_bytes(tokenizer, i) for i in range(tokenizer.vocab_size)]
        self.token_label = [token_label(b) for b in self.token_bytes]
        if model.cfg.n_experts and model.cfg.capacity_factor is not None and model.cfg.capacity_in_eval:
            log.warning("this model limits expert capacity at inference (capacity_in_eval): the tokens of a "
                        "batch compete for expert slots, so a request's output can depend on the others")

    # ------------------------------------------------------------------ control
    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, request: Request) -> None:
        """Queue a request; it joins the batch at the next step with a free row."""
        self.submit_all([request])

    def submit_all(self, requests: list[Request]) -> None:
        """Queue requests together or not at all: QueueFull when they would leave more than max_queue
        waiting beyond the free rows, Closing after `close`."""
        with self._lock:
            if self._closing:
                raise Closing("the server is shutting down")
            self._forget_cancelled()
            room = self.max_queue + max(0, self.max_batch - len(self.rows)) - len(self.waiting)
            if len(requests) > room:
                raise QueueFull(f"{len(self.rows)} requests are decoding and {len(self.waiting)} waiting "
                                f"(--max-batch {self.max_batch}, --max-queue {self.max_queue})")
            self.waiting.extend(requests)
            self._lock.notify()

    def stop_accepting(self) -> None:
        """Refuse new requests (Closing); those in flight go on."""
        with self._lock:
            self._closing = True
            self._lock.notify()

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Take no new requests; let those in flight finish (or cancel them), then stop the loop."""
        with self._lock:
            self._closing = True
            if cancel:
                for r in (*self.rows, *self.waiting, *self._admitting):
                    r.cancel()
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def busy(self) -> tuple[int, int]:
        """(requests admitted: decoding or being prefilled, requests waiting)."""
        with self._lock:
            return len({*self.rows, *self._admitting}), len(self.waiting)

    @property
    def closing(self) -> bool:
        return self._closing

    def _forget_cancelled(self) -> None:
        """Waiting requests whose client went away leave the queue (under the lock) and end now."""
        if any(r.cancelled for r in self.waiting):
            gone = [r for r in self.waiting if r.cancelled]
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
            for r in gone:
                self._finish(r, "cancelled")

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while not self.rows and not self.waiting and not self._closing:
                    self._lock.wait()
                if self._closing and not self.rows and not self.waiting:
                    return
                self._forget_cancelled()
                new = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.max_batch - len(self.rows)))]
                self._admitting = new
            try:
                self.step(new)
            except Exception as e:  # a bug in the batched pass: end what is in flight, keep serving
                log.exception("a step failed")
                for r in [*self.rows, *new]:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                self.rows = []
            with self._lock:
                self._admitting = []

    @torch.no_grad()
    def step(self, new: list[Request] = ()) -> None:
        """One step: admit `new` (prefill each), then decode every row by one token."""
        for r in [r for r in self.rows if r.cancelled]:
            self._retire(r, "cancelled")
        for r in new:
            if r.cancelled:
                self._finish(r, "cancelled")
                continue
            try:
                self._prefill(r)
            except Exception as e:  # this request alone fails (the rows are untouched)
                log.exception("%s: the prefill failed", r.id)
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
        if self.rows:
            self._decode()

    def _prefill(self, r: Request) -> None:
        """The prompt alone through the model into a fresh one-row cache, as offline generation does,
        then into a free row of the slot cache; samples the first token."""
        r.generator = torch.Generator(device=self.device).manual_seed(
            r.sampling.seed if r.sampling.seed is not None else secrets.randbits(63))
        r.text = TextStream(self.tokenizer, r.sampling.stop)
        L = len(r.prompt_ids)
        cache = KVCache(self.cfg, 1, L + r.max_tokens, dtype=self.dtype, device=self.device)
        ids = torch.tensor([r.prompt_ids], device=self.device)
        positions = torch.arange(L, device=self.device)[None]
        with self._observing(r.trace) as seen:
            logits = self.model(ids, cache=cache, positions=positions, last_only=not r.prompt_logprobs)[0]
        logits = logits[..., :self.vocab].float()  # ids past the tokenizer's (a padded vocabulary) never come out
        prompt_lp = prompt_top = None
        if r.prompt_logprobs:
            logp = logits[:-1].log_softmax(-1)
            target = torch.tensor(r.prompt_ids[1:], device=logits.device)
            prompt_lp = [None, *logp.gather(1, target[:, None])[:, 0].tolist()]
            prompt_top = [None, *[self._top(row, r.logprobs) for row in logp]] if r.logprobs else None
        r.position, r.prompt_scores = L, (prompt_lp, prompt_top)
        trace = None
        if r.trace:
            trace = self._step_trace(seen, row=0, query=L - 1, flat=L - 1, logits=logits[-1], position=L - 1,
                                     token=r.prompt_ids[-1])
            trace["prompt"] = [{"position": t, "token": self.token_text[i], "routes": self._routes(seen, t)}
                               for t, i in enumerate(r.prompt_ids)]
        if r.max_tokens == 0:  # scoring the prompt only
            self._finish(r, "length")
            return
        if self._emit_next(r, logits[-1:], trace):
            self.cache.load(len(self.rows), cache)
            self.rows.append(r)

    def _decode(self) -> None:
        n = len(self.rows)
        ids = torch.tensor([[r.last] for r in self.rows], device=self.device)
        positions = torch.tensor([[r.position] for r in self.rows], device=self.device)
        self.cache.prepare(n, max(r.position for r in self.rows) + 1)
        with self._observing(any(r.trace for r in self.rows)) as seen:
            logits = self.model(ids, cache=self.cache, positions=positions, last_only=True)[:, -1]
        logits = logits[..., :self.vocab].float()
        self.steps += 1
        # what every row needs, in one op each: finiteness, and the greedy rows' tokens (argmax is exact
        # whatever the batch); sampled rows draw one by one, each from its own generator
        finite = torch.isfinite(logits).all(-1).tolist()
        greedy = logits.argmax(-1).tolist()
        done = []
        for b, r in enumerate(self.rows):
            r.position += 1
            try:
                trace = self._step_trace(seen, row=b, query=0, flat=b, logits=logits[b], position=r.position - 1,
                                         token=r.last) if r.trace else None
                going = self._emit_next(r, logits[b:b + 1], trace, finite[b], greedy[b])
            except Exception as e:  # sampling or sending failed for this row alone: it ends, the others go on
                log.exception("%s: a step failed", r.id)
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                going = False
            if not going:
                done.append(r)
        for r in done:
            self._retire(r, None)

    def _emit_next(self, r: Request, logits: torch.Tensor, trace: dict | None, finite: bool | None = None,
                   greedy: int | None = None) -> bool:
        """Sample r's next token from logits (1, vocab) and send it; False when the request is over.
        `finite` and `greedy` (the argmax) may come precomputed for the whole batch."""
        if not (bool(torch.isfinite(logits).all()) if finite is None else finite):
            self._finish(r, "error", error="the model's output is not finite; its weights may have diverged")
            return False
        if r.sampling.temperature < GREEDY_BELOW:
            token = int(logits[0].argmax()) if greedy is None else greedy
        else:
            token = int(next_token(logits, r.sampling, r.generator)[0])
        lp = top = None
        if r.logprobs is not None:
            logp = logits[0].log_softmax(-1)
            lp = float(logp[token])
            top = self._top(logp, r.logprobs) if r.logprobs else []
        if trace is not None:
            trace["chosen"] = self.token_text[token]
        r.generated += 1
        r.last = token
        if token in r.sampling.stop_ids:
            self._finish(r, "stop")
            return False
        piece = r.text.add(token)
        r.emit(TokenEvent(token, piece, lp, top, trace))
        if r.text.stopped:
            self._finish(r, "stop")
            return False
        if r.generated >= r.max_tokens:
            self._finish(r, "length")
            return False
        return True

    def _retire(self, r: Request, reason: str | None) -> None:
        """Free r's row, moving the last row into it so the active rows stay [0, n)."""
        i, last = self.rows.index(r), len(self.rows) - 1
        if i != last:
            self.cache.move(last, i)
            self.rows[i] = self.rows[last]
        self.rows.pop()
        if reason is not None:
            self._finish(r, reason)

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.finished:
            return
        r.finished = True
        self.finished[reason] += 1
        lp, top = r.prompt_scores
        tail = r.text.flush() if r.text is not None and reason in ("stop", "length") else ""
        r.emit(Finished(reason, tail, len(r.prompt_ids), r.generated, lp, top, error))
        log.info("%s %s: %d prompt + %d new tokens in %.2f s", r.id, reason, len(r.prompt_ids), r.generated,
                 time.perf_counter() - r.started)

    # ------------------------------------------------------------------ what a step shows
    def _top(self, logp: torch.Tensor, n: int) -> list[tuple[int, float]]:
        top = logp.topk(min(n, logp.numel()))
        return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))

    def _observing(self, on: bool):
        return observe(self.model) if on else nullcontext({})

    def _routes(self, seen: dict, token: int) -> list[dict]:
        """Token `token`'s route (its flattened index in the pass) in every MoE layer."""
        routes = []
        for i, block in enumerate(self.model.blocks):
            r = seen["routing"].get(block.ffn)
            if r is None:
                continue
            slots = seen.setdefault("slots", {})
            if block.ffn not in slots:
                slots[block.ffn] = describe_slots(r)
            experts, weights, kinds, froms = (part[token] for part in slots[block.ffn])
            routes.append({"layer": i, "experts": experts, "weights": [round(w, 4) for w in weights],
                           "kinds": kinds, "from": froms})
        return routes

    def _step_trace(self, seen: dict, row: int, query: int, flat: int, logits: torch.Tensor, position: int,
                    token: int) -> dict:
        """What one token (query `query` of batch row `row`, token `flat` of the flattened pass) did in the
        pass just run: its route in every MoE layer, what it attended to in every layer (mean over heads),
        and the odds of the next token (temperature 1, unfiltered)."""
        attention = []
        for i, block in enumerate(self.model.blocks):
            probs, keys = seen["attention"][block.attn], seen["keys"][block.attn]
            p = probs[row, :, query].mean(0)  # (Tk,)
            k = keys[row] if keys.dim() == 2 else keys
            shown = [(int(kp), round(float(pp), 4)) for kp, pp in zip(k.tolist(), p.tolist(), strict=True)
                     if pp >= ATTENTION_FLOOR and kp >= 0]
            attention.append({"layer": i, "kind": "rope" if block.attn.use_rope else "nope",
                              "chunk": block.attn.chunk, "keys": sorted(shown)})
        odds = logits.softmax(-1).topk(min(TOP_ODDS, logits.numel()))
        return {"position": position, "token": self.token_text[token], "routes": self._routes(seen, flat),
                "attention": attention,
                "odds": [(self.token_text[int(i)], round(float(q), 4)) for q, i in zip(odds.values, odds.indices,
                                                                                         strict=True)]}

