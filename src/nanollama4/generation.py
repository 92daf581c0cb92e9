"""Text generation: prefill the prompt into a KV cache, then decode one token per step on the cache.

Prompts of different lengths share a batch by left padding: each row gets its own positions (padding
is -1), so RoPE angles, chunk boundaries and NoPE temperatures are those the prompt would have alone,
and a row generates exactly what it would generate by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .attention import KVCache
from .errors import GenerationError
from .model import Transformer
from .ops.experts import few_assignments
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen and where a row stops: one object, validated once, passed whole.

    The generation functions also take these fields as keywords (`generate(..., temperature=0)`),
    which build a Sampling (or change the one given).
    """

    temperature: float = 1.0  # 0 = greedy (always the most likely token); higher = more random
    top_k: int | None = None  # sample among the k most likely tokens only
    top_p: float | None = None  # sample among the most likely tokens holding this probability mass
    seed: int | None = None  # seeds the sampler's own generator; None = torch's global RNG
    stop: tuple[str, ...] = ()  # text: a row ends right before the first of these (not returned)
    stop_ids: tuple[int, ...] = ()  # token ids: a row ends at the first of these

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_ids", (self.stop_ids,) if isinstance(self.stop_ids, int)
                           else tuple(self.stop_ids))
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise GenerationError(f"temperature ({self.temperature!r}) must be 0 (greedy) or a positive number")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise GenerationError(f"top_k ({self.top_k!r}) must be a positive integer or None")
        if self.top_p is not None and not 0 < self.top_p <= 1:  # NaN fails this too
            raise GenerationError(f"top_p ({self.top_p!r}) must be in (0, 1] or None")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise GenerationError(f"seed ({self.seed!r}) must be an integer from 0 to 2^63 - 1, or None")


def _sampling(sampling: Sampling | None, changes: dict[str, Any]) -> Sampling:
    """`sampling` with the keyword settings applied (a default Sampling when None)."""
    if sampling is not None and not isinstance(sampling, Sampling):
        raise GenerationError(f"sampling must be a Sampling (got {sampling!r}); pass its fields as keywords, "
                              "e.g. temperature=0.8")
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Sampling)})
    if unknown:
        raise GenerationError(f"unknown sampling settings {unknown}; valid: "
                              f"{', '.join(f.name for f in dataclasses.fields(Sampling))}")
    return dataclasses.replace(sampling or Sampling(), **changes)


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, and outside the smallest set whose probability reaches top_p.

    Ties at the k-th value are kept (they are equally likely). top_p keeps a token when the probability of
    the tokens strictly more likely than it is still below top_p, so the most likely token always stays.
    """
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        ahead = probs.cumsum(-1) - probs  # probability mass strictly ahead of each token
        beyond = ahead >= top_p
        beyond[..., 0] = False  # the most likely token, even for a top_p that float32 rounds to 0
        drop = torch.zeros_like(ahead, dtype=torch.bool).scatter(-1, order, beyond)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


GREEDY_BELOW = 1e-6  # temperatures below this are greedy: dividing the logits by them would overflow


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row from logits (B, vocab): argmax when temperature is 0 (or below GREEDY_BELOW,
    where the sharpened distribution is the argmax's anyway), else sample."""
    if sampling.temperature < GREEDY_BELOW:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def iter_tokens(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                sampling: Sampling | None = None, *, slide: bool = False, compile: bool = False,
                vocab: int | None = None, **settings: Any) -> Iterator[torch.Tensor]:
    """Yield the next token of every prompt (B,) at each step, max_new_tokens times.

    The prompts are prefilled in one forward pass (left-padded to the longest), then each step feeds
    only the new tokens through the model, attending to the cache.

    The context never grows past the model's max_seq_len. Without `slide`, asking for more is a
    ValueError. With `slide`, when the context is full the oldest tokens are dropped: the last
    max_seq_len // 2 tokens of each row are prefilled afresh (from position 0, as in training windows)
    and decoding goes on, so any length can be generated at the cost of one prefill per half-context.

    `compile` runs the one-token decode steps through torch.compile (see `compiled_decoder`): the first
    call for a model and batch size compiles for a while (2-30 s here), then each step is much cheaper
    for small models, whose decoding is bound by the cost of launching hundreds of tiny operations
    rather than by arithmetic. MoE batches with more assignments than experts decode eagerly.

    `vocab` (the tokenizer's size) keeps ids at or past it from being sampled: a model whose vocabulary
    is padded beyond its tokenizer's would otherwise, now and then, produce an id nothing can decode.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt needs at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens ({max_new_tokens!r}) must be a non-negative integer")
    sampling = _sampling(sampling, settings)
    limit = model.cfg.max_seq_len
    longest = max(len(p) for p in prompts)
    if not slide and longest + max_new_tokens > limit:
        raise GenerationError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_seq_len ({limit}); shorten the prompt, ask for fewer tokens, or slide the context")
    model.eval()
    generator = None if sampling.seed is None else torch.Generator(device=_device(model)).manual_seed(sampling.seed)
    keep = max(1, limit // 2)
    rows = [list(p) if len(p) < limit else list(p)[-keep:] for p in prompts]  # a full prompt slides first
    remaining = max_new_tokens
    while remaining > 0:
        steps = min(remaining, limit - max(len(r) for r in rows))
        for tok in _decode_window(model, rows, steps, sampling, generator, compile, vocab):
            for row, t in zip(rows, tok.tolist(), strict=True):
                row.append(t)
            yield tok
        remaining -= steps
        rows = [r[-keep:] for r in rows]


def _device(model: Transformer) -> torch.device:
    return next(model.parameters()).device


_compiled_forward: Callable[..., torch.Tensor] | None = None


def compiled_decoder(model: Transformer) -> Callable[..., torch.Tensor]:
    """model's forward through torch.compile with dynamic shapes: one compiled function for all models.

    Dynamic shapes let one graph serve every cache length, so decoding does not recompile at each step
    (batch size 1 and each model/dtype get graphs of their own). The model code avoids graph breaks on
    this path as long as batch x experts_per_token <= n_experts (MoE experts gathered on the graph, no
    host reads); `iter_tokens` decodes larger batches eagerly. The compiled function is of the class's
    forward, bound here, so it keeps no model alive.
    """
    global _compiled_forward
    if _compiled_forward is None:
        _compiled_forward = torch.compile(Transformer.forward, dynamic=True)
    return functools.partial(_compiled_forward, model)


def _compiles_well(model: Transformer, batch: int) -> bool:
    """Whether a decode step of this batch stays one graph (see compiled_decoder)."""
    cfg = model.cfg
    return cfg.n_experts == 0 or batch * cfg.experts_per_token <= few_assignments(cfg.n_experts, compiling=True)


def _decode_window(model: Transformer, prompts: list[list[int]], steps: int, sampling: Sampling,
                   generator: torch.Generator | None, compile: bool = False, vocab: int | None = None
                   ) -> Iterator[torch.Tensor]:
    """Prefill prompts (left-padded, per-row positions) into a fresh cache and decode `steps` tokens."""
    device, dtype = _device(model), next(model.parameters()).dtype
    B, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, longest, dtype=torch.long, device=device)
    positions = torch.full((B, longest), -1, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        positions[b, longest - len(p):] = torch.arange(len(p))
    cache = KVCache(model.cfg, B, longest + steps, dtype=dtype, device=device)
    logits = model(ids, cache=cache, positions=positions, last_only=True)[:, -1]
    next_pos = positions[:, -1:] + 1  # (B, 1)
    decode = compiled_decoder(model) if compile and _compiles_well(model, B) else model
    for step in range(steps):
        tok = next_token(logits[..., :vocab], sampling, generator)
        yield tok
        if step + 1 < steps:
            logits = decode(tok[:, None], cache=cache, positions=next_pos, last_only=True)[:, -1]
            next_pos = next_pos + 1


def generate_ids(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: Sampling | None = None, *, slide: bool = False, compile: bool = False,
                 vocab: int | None = None, **settings: Any) -> list[list[int]]:
    """New token ids for each prompt; a row ends at (and keeps) its first stop id."""
    sampling = _sampling(sampling, settings)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for tok in iter_tokens(model, prompts, max_new_tokens, sampling, slide=slide, compile=compile, vocab=vocab):
        for b, t in enumerate(tok.tolist()):
            if not done[b]:
                out[b].append(t)
                done[b] = t in sampling.stop_ids
        if all(done):
            break
    return out


def generate(model: Transformer, tokenizer: Tokenizer, prompt: str | Sequence[str], max_new_tokens: int = 256,
             sampling: Sampling | None = None, *, slide: bool = False, compile: bool = False,
             **settings: Any) -> str | list[str]:
    """Continue one prompt (returns its continuation) or a list of prompts (returns a list).

    Generation for a row stops at a stop id or right before a stop string, which is not included in the
    returned text. `slide` lets the context slide past max_seq_len and `compile` compiles the decode
    step (see iter_tokens).
    """
    sampling = _sampling(sampling, settings)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    encoded = [tokenizer.encode(p) for p in prompts]
    texts = ["" for _ in prompts]
    ids: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for tok in iter_tokens(model, encoded, max_new_tokens, sampling, slide=slide, compile=compile,
                           vocab=tokenizer.vocab_size):
        for b, t in enumerate(tok.tolist()):
            if done[b]:
                continue
            if t in sampling.stop_ids:
                done[b] = True
                continue
            ids[b].append(t)
            texts[b], done[b] = _cut_at_stop(tokenizer.decode(ids[b]), sampling.stop)
        if all(done):
            break
    return texts[0] if isinstance(prompt, str) else texts


def stream(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 256,
           sampling: Sampling | None = None, *, slide: bool = False, compile: bool = False,
           **settings: Any) -> Iterator[str]:
    """Yield the continuation of one prompt piece by piece, as soon as each token is decoded (see
    `TextStream` for what is held back and why)."""
    sampling = _sampling(sampling, settings)
    text = TextStream(tokenizer, sampling.stop)
    for tok in iter_tokens(model, [tokenizer.encode(prompt)], max_new_tokens, sampling, slide=slide,
                           compile=compile, vocab=tokenizer.vocab_size):
        if int(tok[0]) in sampling.stop_ids:
            break
        piece = text.add(int(tok[0]))
        if piece:
            yield piece
        if text.stopped:
            break
    if rest := text.flush():
        yield rest


class TextStream:
    """Token ids in, text out as soon as it is safe to show: the continuation of one row, cut right before
    the first stop string, exactly as `generate` returns it once joined.

    All ids are decoded each time and only the new suffix is given out, so a multi-byte character split
    across BPE tokens appears once it is complete; the last len(longest stop) - 1 characters are held back
    while they could still grow into a stop string. `generation.stream` and the server use it.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.shown = 0  # characters already given out
        self.stopped = False  # a stop string has appeared; nothing more will be given out
        self._hold = max((len(s) - 1 for s in self.stop), default=0)

    def add(self, token_id: int) -> str:
        """Take the next token; return the text that became safe to show ("" if none)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        text, self.stopped = _cut_at_stop(self.tokenizer.decode(self.ids), self.stop)
        safe = len(text) if self.stopped else len(text) - self._hold
        while safe > self.shown and text[safe - 1] == "\ufffd" and not self.stopped:
            safe -= 1  # a character whose bytes are not all here yet
        if safe <= self.shown:
            return ""
        piece, self.shown = text[self.shown:safe], safe
        return piece

    def flush(self) -> str:
        """The text still held back, at the end of the row."""
        text = self.text
        piece, self.shown = text[self.shown:], max(self.shown, len(text))
        return piece

    @property
    def text(self) -> str:
        """The whole continuation so far, cut before a stop string."""
        return _cut_at_stop(self.tokenizer.decode(self.ids), self.stop)[0]


def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Text up to the first stop string, and whether one was found."""
    cuts = [text.find(s) for s in stop if s and s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


@torch.no_grad()
def sample(model: Transformer, ids: torch.Tensor, max_new_tokens: int, sampling: Sampling | None = None,
           generator: torch.Generator | None = None, **settings: Any) -> torch.Tensor:
    """The plain loop without a cache: recompute the whole context for each new token (a reference and a
    baseline for the benchmark). Continues ids (B, T); returns (B, T + new)."""
    sampling = _sampling(sampling, settings)
    model.eval()
    limit = model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(ids[:, -limit:], last_only=True)[:, -1, :].float()  # (B, vocab)
        nxt = next_token(logits, sampling, generator)
        ids = torch.cat([ids, nxt[:, None].to(ids.device)], dim=1)
    return ids
