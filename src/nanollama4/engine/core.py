"""The engine: requests in, one `step()` at a time, events out.

    caller (generate, stream, explain --generate, the server's thread)
       | add(Request, ...)                     each Request: prompt ids, max_tokens, Sampling, emit
       v
    step():  _schedule     retire cancelled rows; admit waiting requests into free rows (engine/scheduler.py);
                           each new prompt into a cache of the runner's (whole prompts grouped into one call
                           of the C++ step where it applies, else a chunk per step), its first token chosen
                           and sent, then the runner seats it in its row
             _run          every row's newest token through the model in one batched pass  (engine/runner.py)
             _postprocess  each row's next token by its own Sampling and tokens (`sampling.choose`);
                           TextStream decides where it stops; a traced row's step is written by the
                           StepObserver (engine/trace.py); finished rows leave, the last row moving into the gap
       |
       v  emit(TokenEvent) per new token, emit(Finished) once per request

Rows never see each other: attention is masked per row by position and the dropless MoE routes each
token alone, so a request's tokens do not depend on what else is decoding (up to float rounding of
differently shaped products; the tests check token equality), and several prompts generated together
equal each generated alone.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from contextlib import nullcontext

import torch

from ..base.errors import GenerationError
from ..model.attention import KVCache
from ..model.tokenizer import Tokenizer, token_bytes, token_label
from ..model.transformer import Transformer
from .cache import SlotCache, check_cache_fits, held
from .observe import observe
from .request import Event, Finished, Request, TokenEvent
from .runner import Prefill, Runner
from .sampling import Sampling, TextStream, choose
from .scheduler import Scheduler
from .trace import StepObserver, StepTrace

__all__ = ["Engine", "Request", "TokenEvent", "Finished", "Event"]

log = logging.getLogger("nanollama4.engine")
NOT_FINITE = "the model's output is not finite; its weights may have diverged"


class Engine:
    """The model, its slot cache, and the requests it is continuing; `step()` advances all of them. Which
    request is where (waiting, prefilling, in which row) is the `scheduler`'s; the engine runs the passes,
    chooses the tokens and sends them.

    `context`: the most tokens a row holds (prompt and continuation; default and at most the model's
    max_seq_len). `vocab`: the ids that may be sampled (default the tokenizer's size; a model's padded
    vocabulary beyond it never comes out). `slide`: a row whose context is full keeps its last
    context // 2 tokens, re-prefilled from position 0, and goes on (any length, one prefill per
    half-context); without it a request longer than the context is refused. `compile`: the batched
    pass runs through torch.compile where it stays one graph (`runner.compiled_decoder`). `max_queue`:
    the most requests that may wait beyond the free rows (None: any number; past it `add` raises QueueFull).
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, *, max_batch: int = 16,
                 max_context: int | None = None, vocab: int | None = None, slide: bool = False,
                 compile: bool = False, max_queue: int | None = None) -> None:
        self.scheduler = Scheduler(max_batch, max_queue)
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
        self.steps = 0  # batched decode steps run
        self.finished: Counter[str] = Counter()  # requests ended, by reason
        self.fail_fast = False  # True: an exception in a request's prefill or sampling propagates (offline use)
        if self.cfg.capacity_at_inference:
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

    @functools.cached_property
    def observer(self) -> StepObserver:
        """Made at the first traced step (the token texts it shows decode the whole vocabulary once)."""
        return StepObserver(self.model, self.token_text)

    # ------------------------------------------------------------------ requests in
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

    def add(self, *requests: Request) -> None:
        """Queue requests, each checked first (none is queued when one is refused): the one way in. They
        join the batch at the next steps with free rows, oldest first."""
        for r in requests:
            self.check(r)
        self.scheduler.add(requests)

    # the scheduler's state, read where the engine's callers have always read it
    @property
    def rows(self) -> list[Request]:
        """The decoding requests: request i in cache row i."""
        return self.scheduler.rows

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting, admitted or decoding."""
        return self.scheduler.has_work

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens a step prefills per request."""
        return self.scheduler.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int) -> None:
        self.scheduler.prefill_chunk = tokens

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_work:
            self.step()

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self, new: list[Request] | None = None) -> None:
        """One step, in three parts: `_schedule` (admit `new`, default the waiting requests the free rows take;
        advance every prompt being prefilled by one chunk, a prompt that is done choosing its first token and
        taking its row), `_run` (every row's newest token through the model in one batched pass) and
        `_postprocess` (each row's next token chosen, traced, sent; finished rows retired).

        Prefilling long prompts a chunk per step (`prefill_chunk` tokens) keeps a long prompt admitted
        mid-stream from stalling the rows that are decoding for its whole length."""
        rows = self._schedule(new)
        if rows:
            logits, seen = self._run(rows)
            self._postprocess(rows, logits, seen)

    def _schedule(self, new: list[Request] | None) -> list[Request]:
        """Retire cancelled requests, admit new ones, prefill a chunk of each admitted prompt, slide the rows
        whose context is full; the rows to decode this step."""
        for r in self.scheduler.cancelled():
            self._retire(r, "cancelled")
        for r in self.scheduler.take() if new is None else new:
            if r.cancelled:
                self._retire(r, "cancelled")
                continue
            self._start(r)
            self.scheduler.admit(r)
        prefills = self.scheduler.prefills()
        together = {id(r) for r in self._prefill_together(prefills)}
        for r in prefills:
            if id(r) in together:
                continue
            try:
                self._prefill(r)
            except Exception as e:  # this request alone fails (the rows are untouched)
                self._failed(r, e, "the prefill failed")
        rows = self.rows
        if self.slide:  # a row predicts from at most context - 1 tokens; at context it slides
            for b, r in enumerate(rows):
                if r.position >= self.context - 1:
                    self._slide(b, r)
        return rows

    # ------------------------------------------------------------------ prefill
    def _start(self, r: Request) -> None:
        """A request's own state at admission: its generator, its text, its one-row prefill cache."""
        if self.slide and len(r.prompt_ids) >= self.context:  # a full prompt slides first
            r.prompt_ids = r.prompt_ids[-max(1, self.context // 2):]
        r.generator = r.sampling.generator(self.device)
        r.text = TextStream(self.tokenizer, r.sampling)
        r.tokens = list(r.prompt_ids)
        r.prefill_cache, r.prefilled = None, 0  # (made at its first chunk, unless it is prefilled with others)

    def _failed(self, r: Request, e: Exception, what: str) -> None:
        """r alone ends with error e (the other requests and the rows are untouched)."""
        if self.fail_fast:
            raise e
        log.exception("%s: %s", r.id, what)
        self._retire(r, "error", error=f"{type(e).__name__}: {e}")

    def _prefill_together(self, prefills: list[Request]) -> list[Request]:
        """The prompts that go in whole at this step, untraced and unscored, in the runner's groups
        (`Runner.groups`, `Runner.prefill_together`: the C++ step, one call a group), each then as
        `_prefilled`; the requests taken ([] where none)."""
        whole = [r for r in prefills if not (r.prefilled or r.trace or r.prompt_logprobs)
                 and self.scheduler.chunk(r)[1] == len(r.prompt_ids)]
        taken: list[Request] = []
        for indices in self.runner.groups([r.prompt_ids for r in whole]):
            group = [whole[i] for i in indices]
            try:
                done = self.runner.prefill_together([r.prompt_ids for r in group])
            except Exception:  # each is prefilled alone instead, so that a failure ends only its own request
                if self.fail_fast:
                    raise
                log.exception("prompts prefilled together failed; each goes in alone")
                continue
            if done is None:
                return taken
            for r, cache, logits in zip(group, *done, strict=True):
                r.prefilled = len(r.prompt_ids)
                try:
                    self._prefilled(r, logits[None], cache, {})
                except Exception as e:  # noqa: BLE001 (this request alone fails)
                    self._failed(r, e, "the prefill failed")
            taken += group
        return taken

    def _prefill(self, r: Request) -> None:
        """The next chunk of r's prompt (`Scheduler.chunk`) into its one-row cache; after the last, its first
        token is chosen and the cache copied into the row the scheduler seats it in (`_prefilled`)."""
        L = len(r.prompt_ids)
        if r.prefill_cache is None:
            r.prefill_cache = self.runner.prefill_cache(L, plain=r.trace)
        cache = r.prefill_cache
        start, end = self.scheduler.chunk(r)
        ids = torch.tensor([r.prompt_ids[start:end]], device=self.device)
        with observe(self.model) if r.trace else nullcontext({}) as seen:
            logits = self.runner.prefill(ids, cache, start=start, last_only=not r.prompt_logprobs,
                                         head=end == L)[0]  # a chunk before the last only fills the cache
        r.prefilled = end
        if end < L:
            return
        self._prefilled(r, logits, cache, seen)

    def _prefilled(self, r: Request, logits: torch.Tensor, cache: Prefill, seen: dict) -> None:
        """r's whole prompt is in `cache`, logits (its positions or its last, vocab) from it: score the prompt
        if asked, choose and send its first token, and seat it in a row (the cache copied there)."""
        L = len(r.prompt_ids)
        r.prefill_cache = None
        logits = logits[..., :self.vocab].float()  # ids past the tokenizer's (a padded vocabulary) never come out
        if r.prompt_logprobs:
            logp = logits[:-1].log_softmax(-1)
            target = torch.tensor(r.prompt_ids[1:], device=logits.device)
            r.prompt_scores = ([None, *logp.gather(1, target[:, None])[:, 0].tolist()],
                               [None, *[self._top(row, r.logprobs) for row in logp]] if r.logprobs else None)
        r.position = L
        if r.max_tokens == 0:  # scoring the prompt only
            self._retire(r, "length")
            return
        (token,) = choose(logits[-1:], [r])
        if isinstance(token, Exception):
            raise token
        trace = None
        if r.trace and token is not None:
            trace = self.observer.prefilled(seen, r.prompt_ids, logits[-1], [held(layer, 0) for layer in cache.layers],
                                            r.sampling, token)
        if self._emit(r, token, logits[-1], trace):
            self.runner.seat(self.scheduler.seat(r), cache)
        else:
            self.scheduler.retire(r)

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
    def _run(self, rows: list[Request]) -> tuple[torch.Tensor, dict]:
        """The rows' logits (rows, vocab) in float32, the ids past the tokenizer's cut off, from one batched
        pass (observed when a row is traced: `seen`)."""
        with observe(self.model) if any(r.trace for r in rows) else nullcontext({}) as seen:
            logits = self.runner.decode([r.last for r in rows], [r.position for r in rows])
        self.steps += 1
        return logits[..., :self.vocab].float(), seen

    def _postprocess(self, rows: list[Request], logits: torch.Tensor, seen: dict) -> None:
        """Each row's next token (`sampling.choose`), its trace, its event; rows that finished leave."""
        tokens = choose(logits, rows)
        done = []
        for b, (r, token) in enumerate(zip(rows, tokens, strict=True)):
            r.position += 1
            try:
                if isinstance(token, Exception):  # its draw failed: this row ends, the others go on
                    raise token
                trace = None
                if r.trace and token is not None:
                    trace = self.observer.decoded(seen, b, r.last, r.position - 1, logits[b],
                                                  [held(layer, b) for layer in self.cache.layers], r.sampling, token,
                                                  r.tokens)
                going = self._emit(r, token, logits[b], trace)
            except Exception as e:  # choosing or sending failed for this row alone: it ends, the others go on
                if self.fail_fast:
                    raise
                log.exception("%s: a step failed", r.id)
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                going = False
            if not going:
                done.append(r)
        for r in done:
            self._retire(r, None)

    def _emit(self, r: Request, token: int | None, logits: torch.Tensor, trace: StepTrace | None) -> bool:
        """Send r's next token, chosen from logits (vocab,); False when the request is over (None: its logits
        were not finite, and it ends in an error)."""
        if token is None:
            self._finish(r, "error", error=NOT_FINITE)
            return False
        lp = top = None
        if r.logprobs is not None:
            logp = logits.log_softmax(-1)
            lp = float(logp[token])
            top = self._top(logp, r.logprobs) if r.logprobs else []
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

    def _top(self, logp: torch.Tensor, n: int) -> list[tuple[int, float]]:
        top = logp.topk(min(n, logp.numel()))
        return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))

    # ------------------------------------------------------------------ retiring
    def _retire(self, r: Request, reason: str | None, error: str | None = None) -> None:
        """r leaves the scheduler (a decoding row's gap is filled by the last row, moved in the cache too),
        then ends with `reason` unless it has already."""
        move = self.scheduler.retire(r)
        if move is not None:
            self.cache.move(*move)
        if reason is not None:
            self._finish(r, reason, error)

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
