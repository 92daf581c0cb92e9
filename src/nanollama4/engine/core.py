"""The engine: requests in, one `step()` at a time, events out.

    caller (generate, stream, explain --generate, the server's thread)
       | add(Request) ...                      each Request: prompt ids, max_tokens, Sampling, emit
       v
    step():  1. scheduler  retire cancelled rows; admit waiting requests into free rows
             2. prefill    each new prompt alone into a one-row cache, a chunk per step, then into its row
             3. runner     every row's newest token through the model in one batched pass
             4. sampler    each row's next token by its own Sampling; TextStream decides where it stops
             5. retire     finished rows leave; the last row moves into the gap
       |
       v  emit(TokenEvent) per new token, emit(Finished) once per request

Rows never see each other: attention is masked per row by position and the dropless MoE routes each
token alone, so a request's tokens do not depend on what else is decoding (up to float rounding of
differently shaped products; the tests check token equality), and several prompts generated together
equal each generated alone.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..attention import KVCache
from ..errors import GenerationError
from ..model import Transformer
from ..observe import describe_slots, observe
from ..tokenizer import Tokenizer, token_bytes, token_label
from .cache import SlotCache, check_cache_fits, held
from .runner import Runner
from .sampling import Sampling, TextStream, filter_logits, next_token

log = logging.getLogger("nanollama4.engine")
TOP_ODDS = 8  # next tokens a traced step lists
PREFILL_CHUNK = 64  # prompt tokens a step prefills per request (longer prompts take several steps)
ATTENTION_FLOOR = 0.002  # a traced step lists the keys a token attended to with at least this probability


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

    reason: str  # "stop" (a stop id or string), "length" (max_tokens), "cancelled" or "error"
    text: str  # text still held back, now safe to show
    prompt_tokens: int
    completion_tokens: int
    prompt_logprobs: list[float | None] | None = None  # with Request.prompt_logprobs: each prompt token's
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    error: str | None = None
    stop_id: int | None = None  # the stop id that ended the request (not sent as a TokenEvent)


Event = TokenEvent | Finished
_ids = itertools.count(1)


@dataclass(eq=False)  # a request is itself: two with equal fields are still two rows
class Request:
    """One prompt to continue. `emit` is called with each event, in order (from the engine's thread when
    the server runs it). max_tokens 0 only scores the prompt (with prompt_logprobs) and ends."""

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
    tokens: list[int] = field(default_factory=list, repr=False)  # the prompt and every token so far
    prefill_cache: KVCache | None = field(default=None, repr=False)  # while the prompt is prefilled in chunks
    prefilled: int = 0  # prompt tokens already in prefill_cache
    generated: int = 0
    position: int = 0  # where the newest token goes
    last: int = 0  # the newest token, fed at the next step
    finished: bool = False
    prompt_scores: tuple = (None, None)  # with prompt_logprobs: each prompt token's and the top ones
    started: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled = True


# ---------------------------------------------------------------------------------------------- the engine
class Engine:
    """The model, its slot cache, and the requests it is continuing; `step()` advances all of them.

    `context`: the most tokens a row holds (prompt and continuation; default and at most the model's
    max_seq_len). `vocab`: the ids that may be sampled (default the tokenizer's size; a model's padded
    vocabulary beyond it never comes out). `slide`: a row whose context is full keeps its last
    context // 2 tokens, re-prefilled from position 0, and goes on (any length, one prefill per
    half-context); without it a request longer than the context is refused. `compile`: the batched
    pass runs through torch.compile where it stays one graph (`runner.compiled_decoder`).
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, *, max_batch: int = 16,
                 max_context: int | None = None, vocab: int | None = None, slide: bool = False,
                 compile: bool = False) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch ({max_batch}) must be >= 1")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.cfg = model.cfg
        self.max_batch = max_batch
        self.context = min(self.cfg.max_seq_len, max_context or self.cfg.max_seq_len)  # prompt + answer, at most
        known = tokenizer.vocab_size if tokenizer is not None else vocab or self.cfg.vocab_size
        self.vocab = min(self.cfg.vocab_size, known)  # the ids that can be sampled and shown
        self.slide = slide
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        check_cache_fits(self.cfg, max_batch, self.dtype, self.device, self.context)
        self.cache = SlotCache(self.cfg, max_batch, self.dtype, self.device, self.context)
        self.runner = Runner(model, self.cache, compile)
        self.rows: list[Request] = []  # request i decodes in cache row i
        self.prefilling: list[Request] = []  # admitted, their prompts prefilled a chunk per step; each holds a row
        self.waiting: deque[Request] = deque()
        self.prefill_chunk = PREFILL_CHUNK
        self.steps = 0  # batched decode steps run
        self.finished: Counter[str] = Counter()  # requests ended, by reason
        self.fail_fast = False  # True: an exception in a request's prefill or sampling propagates (offline use)
        if self.cfg.n_experts and self.cfg.capacity_factor is not None and self.cfg.capacity_in_eval:
            log.warning("this model limits expert capacity at inference (capacity_in_eval): the tokens of a "
                        "batch compete for expert slots, so a request's output can depend on the others")

    # ------------------------------------------------------------------ what the API names each token
    @functools.cached_property
    def token_text(self) -> list[str]:
        return [self.tokenizer.decode([i]) for i in range(self.tokenizer.vocab_size)]

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """Each token's own bytes (a piece of a multi-byte character included)."""
        return [token_bytes(self.tokenizer, i) for i in range(self.tokenizer.vocab_size)]

    @functools.cached_property
    def token_label(self) -> list[str]:
        """Each token's name in the API (`bytes:\\xNN` for a piece of a character): distinct per bytes."""
        return [token_label(b) for b in self.token_bytes]

    # ------------------------------------------------------------------ the scheduler
    def check(self, request: Request) -> None:
        """A GenerationError, in one line, for a request this engine cannot run."""
        n = len(request.prompt_ids)
        if n == 0:
            raise GenerationError("every prompt needs at least one token")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 0:
            raise GenerationError(f"max_new_tokens ({request.max_tokens!r}) must be a non-negative integer")
        if not isinstance(request.sampling, Sampling):
            raise GenerationError(f"sampling must be a Sampling (got {request.sampling!r})")
        if request.sampling.stop and self.tokenizer is None:
            raise GenerationError("stop strings need a tokenizer to read the text; give stop_ids instead")
        if not self.slide and n + request.max_tokens > self.context:
            limit = "max_seq_len" if self.context == self.cfg.max_seq_len else "context"
            raise GenerationError(f"prompt ({n} tokens) + max_new_tokens ({request.max_tokens}) exceeds the "
                                  f"model's {limit} ({self.context}); shorten the prompt, ask for fewer tokens, "
                                  "or slide the context")

    def add(self, request: Request) -> None:
        """Queue a request (checked first); it joins the batch at the next step with a free row."""
        self.check(request)
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        """Whether any request is decoding, being prefilled or waiting."""
        return bool(self.rows or self.prefilling or self.waiting)

    @property
    def free_rows(self) -> int:
        return self.max_batch - len(self.rows) - len(self.prefilling)

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_work:
            self.step()

    @torch.no_grad()
    def step(self, new: list[Request] | None = None) -> None:
        """One step: admit `new` (default: waiting requests, as many as there are free rows), advance every
        prompt being prefilled by one chunk (a prompt that is done samples its first token and takes its
        row), then decode every row by one token.

        Prefilling long prompts a chunk per step (`prefill_chunk` tokens) keeps a long prompt admitted
        mid-stream from stalling the rows that are decoding for its whole length."""
        for r in [r for r in self.rows if r.cancelled]:
            self._retire(r, "cancelled")
        for r in [r for r in self.prefilling if r.cancelled]:
            self.prefilling.remove(r)
            self._finish(r, "cancelled")
        if new is None:
            new = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.free_rows))]
        for r in new:
            if r.cancelled:
                self._finish(r, "cancelled")
                continue
            self._start(r)
            self.prefilling.append(r)
        for r in list(self.prefilling):
            try:
                self._prefill(r)
            except Exception as e:  # this request alone fails (the rows are untouched)
                if self.fail_fast:
                    raise
                log.exception("%s: the prefill failed", r.id)
                self.prefilling.remove(r)
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
        if self.rows:
            self._decode()

    # ------------------------------------------------------------------ prefill
    def _start(self, r: Request) -> None:
        """A request's own state at admission: its generator, its text, its one-row prefill cache."""
        if self.slide and len(r.prompt_ids) >= self.context:  # a full prompt slides first
            r.prompt_ids = r.prompt_ids[-max(1, self.context // 2):]
        r.generator = r.sampling.generator(self.device)
        r.text = TextStream(self.tokenizer, r.sampling)
        r.tokens = list(r.prompt_ids)
        r.prefill_cache, r.prefilled = KVCache(self.cfg, 1, len(r.prompt_ids), dtype=self.dtype, device=self.device), 0

    def _prefill(self, r: Request) -> None:
        """The next chunk of r's prompt into its one-row cache; after the last, its first token is sampled and
        the cache copied into a free row of the slot cache. A traced or scored prompt (every position's
        observations or logits are kept) goes through in one pass."""
        L, cache = len(r.prompt_ids), r.prefill_cache
        whole = r.trace or r.prompt_logprobs
        end = L if whole else min(L, r.prefilled + self.prefill_chunk)
        ids = torch.tensor([r.prompt_ids[r.prefilled:end]], device=self.device)
        with self._observing(r.trace) as seen:
            logits = self.runner.prefill(ids, cache, start=r.prefilled, last_only=not r.prompt_logprobs,
                                         head=end == L)[0]  # a chunk before the last only fills the cache
        r.prefilled = end
        if end < L:
            return
        self.prefilling.remove(r)
        r.prefill_cache = None
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
                                     token=r.prompt_ids[-1], held=[held(layer, 0) for layer in cache.layers])
            trace["kind"], trace["fed"] = "prefill", [self.token_text[i] for i in r.prompt_ids]
            trace["prompt"] = [{"position": t, "token": self.token_text[i], "routes": self._routes(seen, t)}
                               for t, i in enumerate(r.prompt_ids)]
        if r.max_tokens == 0:  # scoring the prompt only
            self._finish(r, "length")
            return
        if self._emit_next(r, logits[-1:], trace):
            self.cache.load(len(self.rows), cache)
            self.rows.append(r)

    def _slide(self, b: int, r: Request) -> None:
        """Row b's context is full (with its newest token, still to be fed, it holds `context` tokens): keep
        its last context // 2 tokens, from position 0. All but the newest are prefilled into the row now;
        the newest is fed by this step's batched pass, as every row's is."""
        keep = r.tokens[-max(1, self.context // 2):]
        if len(keep) > 1:
            cache = KVCache(self.cfg, 1, len(keep) - 1, dtype=self.dtype, device=self.device)
            self.runner.prefill(torch.tensor([keep[:-1]], device=self.device), cache, head=False)
            self.cache.load(b, cache)
        else:
            self.cache.clear(b)
        r.position = len(keep) - 1

    # ------------------------------------------------------------------ decode
    def _decode(self) -> None:
        if self.slide:  # a row predicts from at most context - 1 tokens; at context it slides
            for b, r in enumerate(self.rows):
                if r.position >= self.context - 1:
                    self._slide(b, r)
        with self._observing(any(r.trace for r in self.rows)) as seen:
            logits = self.runner.decode([r.last for r in self.rows], [r.position for r in self.rows])
        logits = logits[..., :self.vocab].float()
        self.steps += 1
        # what every row needs, in one op: the greedy rows' tokens (argmax is exact whatever the batch) and
        # finiteness (max propagates NaN, and a row with +inf or only -inf has no finite maximum); sampled
        # rows draw one by one, each from its own generator
        top, greedy = logits.max(-1)
        finite, greedy = top.isfinite().tolist(), greedy.tolist()
        done = []
        for b, r in enumerate(self.rows):
            r.position += 1
            try:
                trace = None
                if r.trace:
                    trace = self._step_trace(seen, row=b, query=0, flat=b, logits=logits[b],
                                             position=r.position - 1, token=r.last,
                                             held=[held(layer, b) for layer in self.cache.layers])
                    trace["kind"], trace["fed"] = "decode", [self.token_text[r.last]]
                going = self._emit_next(r, logits[b:b + 1], trace, finite[b], greedy[b])
            except Exception as e:  # sampling or sending failed for this row alone: it ends, the others go on
                if self.fail_fast:
                    raise
                log.exception("%s: a step failed", r.id)
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                going = False
            if not going:
                done.append(r)
        for r in done:
            self._retire(r, None)

    # ------------------------------------------------------------------ the sampler
    def _emit_next(self, r: Request, logits: torch.Tensor, trace: dict | None, finite: bool | None = None,
                   greedy: int | None = None) -> bool:
        """Sample r's next token from logits (1, vocab) and send it; False when the request is over.
        `finite` and `greedy` (the argmax) may come precomputed for the whole batch."""
        if not (bool(torch.isfinite(logits).all()) if finite is None else finite):
            self._finish(r, "error", error="the model's output is not finite; its weights may have diverged")
            return False
        if r.sampling.greedy:
            token = int(logits[0].argmax()) if greedy is None else greedy
        else:
            token = int(next_token(logits, r.sampling, r.generator)[0])
        lp = top = None
        if r.logprobs is not None:
            logp = logits[0].log_softmax(-1)
            lp = float(logp[token])
            top = self._top(logp, r.logprobs) if r.logprobs else []
        if trace is not None:
            self._sampled_odds(trace, r.sampling, logits[0], token)
        r.generated += 1
        r.last = token
        r.tokens.append(token)
        piece = r.text.add(token)
        if r.text.stop_id is not None:  # a stop id ends the row; the token is not sent
            self._finish(r, "stop")
            return False
        r.emit(TokenEvent(token, piece, lp, top, trace))
        if r.text.stopped:
            self._finish(r, "stop")
            return False
        if r.generated >= r.max_tokens:
            self._finish(r, "length")
            return False
        return True

    # ------------------------------------------------------------------ retiring
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
        stop_id = r.text.stop_id if r.text is not None else None
        r.emit(Finished(reason, tail, len(r.prompt_ids), r.generated, lp, top, error, stop_id))
        log.info("%s %s: %d prompt + %d new tokens in %.2f s", r.id, reason, len(r.prompt_ids), r.generated,
                 time.perf_counter() - r.started)

    # ------------------------------------------------------------------ what a step shows
    def _sampled_odds(self, trace: dict, sampling: Sampling, logits: torch.Tensor, token: int) -> None:
        """Add to a step's trace the distribution the token was actually drawn from (after temperature,
        top-k, top-p and min_p; greedy: all on the argmax) beside the temperature-1 odds: each listed
        token's probability under it, and the chosen token's under both."""
        if sampling.greedy:
            sampled = torch.zeros_like(logits, dtype=torch.float32)
            sampled[int(logits.argmax())] = 1.0
        else:
            sampled = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p,
                                    sampling.min_p).softmax(-1)
        ids = trace.pop("odds_ids")
        trace["odds"] = [(text, p, float(sampled[i])) for (text, p), i in zip(trace["odds"], ids, strict=True)]
        trace["chosen"] = self.token_text[token]
        trace["chosen_odds"] = [float(logits.float().softmax(-1)[token]), float(sampled[token])]

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
            routes.append({"layer": i, "experts": experts, "weights": weights,  # rounded where shown
                           "kinds": kinds, "from": froms})
        return routes

    def _step_trace(self, seen: dict, row: int, query: int, flat: int, logits: torch.Tensor, position: int,
                    token: int, held: list[int]) -> dict:
        """What one token (query `query` of batch row `row`, token `flat` of the flattened pass) did in the
        pass just run: its route in every MoE layer, what it attended to in every layer (mean over heads),
        the positions each layer's cache holds for the row, and the odds of the next token (temperature 1,
        unfiltered). Values are as computed: a page rounds them once, where it shows them."""
        attention = []
        for i, block in enumerate(self.model.blocks):
            probs, keys = seen["attention"][block.attn], seen["keys"][block.attn]
            p = probs[row, :, query].mean(0)  # (Tk,)
            k = keys[row] if keys.dim() == 2 else keys
            shown = [(int(kp), float(pp)) for kp, pp in zip(k.tolist(), p.tolist(), strict=True)
                     if pp >= ATTENTION_FLOOR and kp >= 0]
            attention.append({"layer": i, "kind": "rope" if block.attn.use_rope else "nope",
                              "chunk": block.attn.chunk, "keys": sorted(shown)})
        odds = logits.softmax(-1).topk(min(TOP_ODDS, logits.numel()))
        return {"position": position, "token": self.token_text[token], "routes": self._routes(seen, flat),
                "attention": attention, "cache": held,
                "odds": [(self.token_text[int(i)], float(q)) for q, i in zip(odds.values, odds.indices, strict=True)],
                "odds_ids": odds.indices.tolist()}
