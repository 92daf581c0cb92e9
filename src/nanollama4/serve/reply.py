"""The answers of `nanollama4 serve` in OpenAI's shapes: one class per endpoint, each writing its whole
response, its streamed chunks, its logprobs and its usage, so that the endpoint picks one once and the
code that waits for the engine's events is the same for both.

Completions answer with `text` (the prompt first when it is echoed) and the legacy logprobs object
(tokens, their log-probabilities, the top alternatives by name, offsets into the text); chat answers
with a `message` (a `delta` when streamed, the first one naming the role) and one logprobs entry per
token with its bytes. Log-probabilities name tokens by `engine.Engine.token_label`, which differs for tokens
of different bytes, so no alternative is lost to a colliding key.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from .schema import ApiError, Params

if TYPE_CHECKING:
    from .engine import BackgroundEngine, Finished, TokenEvent


def failed(end: Finished) -> ApiError:
    """The error a request that ended in an error answers with (whole, or as a stream's `error` event)."""
    return ApiError(500, f"generation failed: {end.error}", kind="server_error")


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Reply:
    """One HTTP call's answers (a choice per prompt), in its endpoint's shape."""

    OBJECT: ClassVar[str]  # the whole response's "object"
    CHUNK: ClassVar[str]  # a streamed chunk's
    PREFIX: ClassVar[str]  # of the response's id

    def __init__(self, engine: BackgroundEngine, params: Params, model_name: str) -> None:
        self.engine, self.params, self.model_name = engine, params, model_name
        self.id = f"{self.PREFIX}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    # ------------------------------------------------------------------ the whole response
    def whole(self, texts: list[str], tokens: list[list[TokenEvent]], ends: list[Finished]) -> dict[str, Any]:
        """The response once every prompt's continuation is over: `texts` and `tokens` per prompt, `ends` their
        Finished events."""
        choices = [self.choice(i, text, events, end)
                   for i, (text, events, end) in enumerate(zip(texts, tokens, ends, strict=True))]
        return {"id": self.id, "object": self.OBJECT, "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage(sum(e.prompt_tokens for e in ends),
                                                   sum(e.completion_tokens for e in ends))}

    def choice(self, index: int, text: str, events: list[TokenEvent], end: Finished) -> dict[str, Any]:
        raise NotImplementedError

    # ------------------------------------------------------------------ the stream
    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        """One server-sent event of the stream."""
        payload = {"id": self.id, "object": self.CHUNK, "created": self.created, "model": self.model_name,
                   "choices": choices, **extra}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def opening(self) -> Iterator[str]:
        """The chunks before the first token."""
        return iter(())

    def token(self, index: int, event: TokenEvent) -> str:
        """The chunk of one new token of prompt `index`, with the step that chose it when traced."""
        choice = {"index": index, "finish_reason": None, **self.token_fields(index, event)}
        if event.trace is not None:
            choice["nanollama4"] = {"token": self.engine.token_text[event.token_id], "step": event.trace.to_json()}
        return self.chunk([choice])

    def token_fields(self, index: int, event: TokenEvent) -> dict[str, Any]:
        raise NotImplementedError

    def last(self, index: int, end: Finished) -> str:
        """The chunk that ends prompt `index`'s choice: its last text (held back for a stop string) and why."""
        if end.reason == "error":
            return f"data: {json.dumps(failed(end).body)}\n\n"
        return self.chunk([{"index": index, "logprobs": None, "finish_reason": end.reason, **self.last_fields(end)}])

    def last_fields(self, end: Finished) -> dict[str, Any]:
        raise NotImplementedError

    def usage(self, prompt: int, completion: int) -> str:
        """The chunk after the last choice's, when `stream_options.include_usage` asked for it."""
        return self.chunk([], usage=usage(prompt, completion))


class CompletionReply(Reply):
    """POST /v1/completions: `text`, and the legacy logprobs object."""

    OBJECT = CHUNK = "text_completion"
    PREFIX = "cmpl"

    def __init__(self, engine: BackgroundEngine, params: Params, model_name: str) -> None:
        super().__init__(engine, params, model_name)
        self.offsets = [len(t) if params.echo else 0 for t in params.prompt_texts]  # where a streamed token starts

    def choice(self, index: int, text: str, events: list[TokenEvent], end: Finished) -> dict[str, Any]:
        p = self.params
        prefix = p.prompt_texts[index] if p.echo else ""
        prompt = (p.prompts[index], end.prompt_logprobs, end.prompt_top) if p.echo else None
        return {"index": index, "text": prefix + text,
                "logprobs": None if p.logprobs is None else self.logprobs(events, prompt),
                "finish_reason": end.reason}

    def opening(self) -> Iterator[str]:
        if self.params.echo:
            for i, text in enumerate(self.params.prompt_texts):
                yield self.chunk([{"index": i, "text": text, "logprobs": None, "finish_reason": None}])

    def token_fields(self, index: int, event: TokenEvent) -> dict[str, Any]:
        fields = {"text": event.text, "logprobs": None if self.params.logprobs is None else
                  self.logprobs([event], start=self.offsets[index])}
        self.offsets[index] += len(self.engine.token_text[event.token_id])
        return fields

    def last_fields(self, end: Finished) -> dict[str, Any]:
        return {"text": end.text}

    def logprobs(self, events: list[TokenEvent], prompt: tuple | None = None, start: int = 0) -> dict[str, list]:
        """Tokens, their log-probabilities, the top alternatives, offsets into the choice's text (from `start`);
        the prompt's tokens first when it is echoed (`prompt`: its ids, log-probabilities and top ones)."""
        entries = [(e.token_id, e.logprob, e.top) for e in events]
        if prompt is not None:
            ids, prompt_lp, prompt_top = prompt
            entries = [*zip(ids, prompt_lp, prompt_top or [None] * len(ids), strict=True), *entries]
        label = self.engine.token_label
        offsets, at = [], start
        for token_id, _, _ in entries:
            offsets.append(at)
            at += len(self.engine.token_text[token_id])
        return {"tokens": [label[t] for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else {label[i]: lp for i, lp in top} for _, _, top in entries],
                "text_offset": offsets}


class ChatReply(Reply):
    """POST /v1/chat/completions: a `message` (streamed: a `delta`), and a logprobs entry per token."""

    OBJECT, CHUNK = "chat.completion", "chat.completion.chunk"
    PREFIX = "chatcmpl"

    def choice(self, index: int, text: str, events: list[TokenEvent], end: Finished) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": None if self.params.logprobs is None else self.logprobs(events),
                "finish_reason": end.reason}

    def opening(self) -> Iterator[str]:
        for i in range(len(self.params.prompts)):
            yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}])

    def token_fields(self, index: int, event: TokenEvent) -> dict[str, Any]:
        return {"delta": {"content": event.text},
                "logprobs": None if self.params.logprobs is None else self.logprobs([event])}

    def last_fields(self, end: Finished) -> dict[str, Any]:
        return {"delta": {"content": end.text} if end.text else {}}

    def logprobs(self, events: list[TokenEvent]) -> dict[str, list]:
        """Each token with its log-probability, its bytes and the top alternatives."""
        label, raw = self.engine.token_label, self.engine.token_bytes
        return {"content": [{"token": label[e.token_id], "logprob": e.logprob, "bytes": list(raw[e.token_id]),
                             "top_logprobs": [{"token": label[i], "logprob": lp, "bytes": list(raw[i])}
                                              for i, lp in (e.top or [])]} for e in events]}
