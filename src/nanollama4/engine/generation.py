"""Text generation: thin callers of the engine (`nanollama4.engine`), which prefills each prompt into a
KV cache and decodes every row one token per step.

`generate` and `stream` continue text, `generate_ids` and `iter_tokens` token ids; `sample` is the plain
loop without a cache, kept as the readable reference the tests compare the engine against. Several
prompts generated together equal each generated alone: each row has its own cache slots, positions and
(with a seed) its own generator.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..base.errors import GenerationError
from ..model.tokenizer import Tokenizer
from ..model.transformer import Transformer
from . import Engine, Finished, Request, TokenEvent
from .runner import compiled_decoder
from .sampling import Sampling, TextStream, filter_logits, next_token, sampling_with

__all__ = ["Sampling", "generate", "stream", "generate_ids", "iter_tokens", "sample", "filter_logits", "next_token",
           "TextStream", "compiled_decoder"]


def _engine(model: Transformer, rows: int, tokenizer: Tokenizer | None, vocab: int | None, slide: bool,
            compile: bool) -> Engine:
    engine = Engine(model, tokenizer, max_batch=rows, vocab=vocab, slide=slide, compile=compile)
    engine.fail_fast = True  # a bug in a pass is the caller's exception, with its traceback
    return engine


def _requests(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling
              ) -> list[list]:
    """Add one request per prompt; returns each one's list of events, filled as the engine steps."""
    if not prompts:
        raise GenerationError("every prompt needs at least one token (no prompts were given)")
    events: list[list] = [[] for _ in prompts]
    engine.add(*[Request(list(p), max_new_tokens, sampling, events[i].append) for i, p in enumerate(prompts)])
    return events


def _failed(end: Finished) -> None:
    if end.reason == "error":
        raise GenerationError(f"generation failed: {end.error}")


@torch.no_grad()
def iter_tokens(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                sampling: Sampling | None = None, *, slide: bool = False, compile: bool = False,
                vocab: int | None = None, **settings: Any) -> Iterator[torch.Tensor]:
    """Yield the next token of every prompt (B,) at each step, max_new_tokens times (stop ids and strings
    are not applied here: see `generate_ids`).

    The context never grows past the model's max_seq_len. Without `slide`, asking for more is a
    GenerationError (a ValueError). With `slide`, when a row's context is full its oldest tokens are
    dropped: its last max_seq_len // 2 tokens are prefilled afresh (from position 0, as in training
    windows) and decoding goes on, so any length can be generated at the cost of one prefill per
    half-context.

    `compile` runs the decode steps through torch.compile (`engine.runner.compiled_decoder`): the first
    call for a model and batch size compiles for a while (2-30 s here), then each step is cheaper for
    small models, whose decoding is bound by the cost of launching hundreds of tiny operations rather
    than by arithmetic. MoE batches of more than 16 rows with more assignments than experts decode eagerly.

    `vocab` (the tokenizer's size) keeps ids at or past it from being sampled: a model whose vocabulary
    is padded beyond its tokenizer's would otherwise, now and then, produce an id nothing can decode.
    """
    sampling = sampling_with(sampling, settings)
    sampling = sampling_with(sampling, {"stop": (), "stop_ids": ()})
    engine = _engine(model, len(prompts), None, vocab, slide, compile)
    events = _requests(engine, prompts, max_new_tokens, sampling)
    if max_new_tokens == 0:
        return
    ready: list[list[int]] = [[] for _ in prompts]  # each row's tokens not yet yielded (long prompts start later)
    while engine.has_work:
        engine.step()
        for row, e in zip(ready, events, strict=True):
            for ev in e:
                if isinstance(ev, Finished):
                    _failed(ev)
                else:
                    row.append(ev.token_id)
            e.clear()
        while all(ready):
            yield torch.tensor([row.pop(0) for row in ready], device=engine.device)


@torch.no_grad()
def generate_ids(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: Sampling | None = None, *, slide: bool = False, compile: bool = False,
                 vocab: int | None = None, **settings: Any) -> list[list[int]]:
    """New token ids for each prompt; a row ends at (and keeps) its first stop id."""
    sampling = sampling_with(sampling, settings)
    engine = _engine(model, max(1, len(prompts)), None, vocab, slide, compile)
    events = _requests(engine, prompts, max_new_tokens, sampling)
    engine.run()
    out = []
    for row in events:
        end = row[-1]
        _failed(end)
        ids = [e.token_id for e in row if isinstance(e, TokenEvent)]
        out.append(ids + ([end.stop_id] if end.stop_id is not None else []))
    return out


@torch.no_grad()
def generate(model: Transformer, tokenizer: Tokenizer, prompt: str | Sequence[str], max_new_tokens: int = 256,
             sampling: Sampling | None = None, *, slide: bool = False, compile: bool = False,
             **settings: Any) -> str | list[str]:
    """Continue one prompt (returns its continuation) or a list of prompts (returns a list).

    Generation for a row stops at a stop id or right before a stop string, which is not included in the
    returned text. `slide` lets the context slide past max_seq_len and `compile` compiles the decode
    step (see iter_tokens).
    """
    sampling = sampling_with(sampling, settings)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    engine = _engine(model, max(1, len(prompts)), tokenizer, None, slide, compile)
    events = _requests(engine, [tokenizer.encode(p) for p in prompts], max_new_tokens, sampling)
    engine.run()
    texts = []
    for row in events:
        _failed(row[-1])
        texts.append("".join(e.text for e in row))
    return texts[0] if isinstance(prompt, str) else texts


@torch.no_grad()
def stream(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 256,
           sampling: Sampling | None = None, *, slide: bool = False, compile: bool = False,
           **settings: Any) -> Iterator[str]:
    """Yield the continuation of one prompt piece by piece, as soon as each token is decoded (see
    `engine.sampling.TextStream` for what is held back and why)."""
    sampling = sampling_with(sampling, settings)
    engine = _engine(model, 1, tokenizer, None, slide, compile)
    (events,) = _requests(engine, [tokenizer.encode(prompt)], max_new_tokens, sampling)
    while engine.has_work:
        engine.step()
        for e in events:
            if isinstance(e, Finished):
                _failed(e)
            if e.text:
                yield e.text
        events.clear()


@torch.no_grad()
def sample(model: Transformer, ids: torch.Tensor, max_new_tokens: int, sampling: Sampling | None = None,
           generator: torch.Generator | None = None, **settings: Any) -> torch.Tensor:
    """The plain loop without a cache: recompute the whole context for each new token (a reference and a
    baseline for the benchmark). Continues ids (B, T); returns (B, T + new)."""
    sampling = sampling_with(sampling, settings)
    model.eval()
    limit = model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(ids[:, -limit:], last_only=True)[:, -1, :].float()  # (B, vocab)
        nxt = next_token(logits, sampling, generator, ids.tolist())
        ids = torch.cat([ids, nxt[:, None].to(ids.device)], dim=1)
    return ids
