"""The HTTP side of `nanollama4 serve`: OpenAI's completions and chat completions over the engine.

Every request field is checked here, before anything reaches the engine, and a bad one is answered with
the API's error object naming it (status 400), so a client library raises a clear BadRequestError.
Streams are server-sent events ending in `data: [DONE]`; a client that goes away cancels its requests,
which leave the batch at the engine's next step. Two fields are ours: `top_k`, and `nanollama4_trace`,
which attaches to each streamed token the step that chose it (routes, attention, odds) for the page.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine.sampling import Sampling, SamplingError
from ..errors import TokenizerError
from ..explain import palette
from .chat import ChatFormat, ChatTemplateError, PlayFormat
from .engine import Closing, Engine, Event, Finished, QueueFull, Request, TokenEvent, log
from .guard import Guard, HostRule

BODY_LIMIT = 1 << 20  # bytes of JSON a request may send
MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_PROMPTS = 64  # prompts in one completions request
MAX_LOGPROBS = {"completions": 5, "chat": 20}  # alternatives per token, OpenAI's limits


class ApiError(Exception):
    """An OpenAI-style error: the status and the object a client library reads."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return Response(json.dumps(body), status_code=self.status, headers=self.headers,
                        media_type="application/json")  # ASCII JSON: any text a client sent can be quoted back


# ---------------------------------------------------------------------------------------------- the fields
class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Body(BaseModel):
    """The fields both endpoints take, with their JSON types; values are checked after (`Sampling` holds the
    limits of the sampling values, shared with the command line and the Python API)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictInt | StrictFloat | None = None
    top_p: StrictInt | StrictFloat | None = None
    top_k: StrictInt | None = None  # ours (vLLM's too); -1 or null: all tokens
    min_p: StrictInt | StrictFloat | None = None  # ours (vLLM's and llama.cpp's too)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = None
    stream_options: _StreamOptions | None = None
    n: StrictInt | None = None
    user: StrictStr | None = None
    frequency_penalty: StrictInt | StrictFloat | None = None
    presence_penalty: StrictInt | StrictFloat | None = None
    logit_bias: dict[str, Any] | None = None
    nanollama4_trace: StrictBool | None = None  # ours: each streamed token with the step that chose it


class CompletionBody(_Body):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr | list[_TextPart]
    name: StrictStr | None = None


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[Message] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None


BODIES: dict[str, type[_Body]] = {"completions": CompletionBody, "chat": ChatBody}
_NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "best_of": (1,), "n": (1,),
            "logit_bias": ({},), "suffix": ("",)}  # accepted at their no-op values only
_RULES = {"prompt": f"must be a string, a list of up to {MAX_PROMPTS} strings, or token ids (a list, or a list "
                    "of lists)", "stop": f"must be a non-empty string or a list of up to {MAX_STOPS} of them",
          "stream_options": 'must be {"include_usage": true|false}',
          "messages": "must be a non-empty list of {role, content} objects"}  # fields whose JSON type is a union


def _bad(param: str, rule: str, value: Any) -> ApiError:
    shown = json.dumps(value)[:80] if not isinstance(value, float) else repr(value)
    return ApiError(400, f"{param} ({shown}) {rule}", param=param)


def _refusal(error: dict, body: dict) -> ApiError:
    """The API's error object for pydantic's first complaint about `body`, naming the field it is about."""
    loc = error["loc"]
    path, value = "", body
    for part in loc:  # union members are named in loc too ("str", "list[int]", ...): not part of the path
        if isinstance(part, int) and isinstance(value, list) and part < len(value):
            path, value = f"{path}[{part}]", value[part]
        elif isinstance(part, str) and isinstance(value, dict) and part in value:
            path, value = f"{path}.{part}" if path else part, value[part]
    if error["type"] == "missing":
        return _bad(path, f"needs {loc[-1]!r}", value)
    top = str(loc[0])
    if top in ("prompt", "stop", "stream_options") or top == "messages" and path == top:
        return _bad(top, _RULES[top], body.get(top))
    rule = {"int_type": "must be an integer", "bool_type": "must be true or false", "string_type": "must be a string",
            "float_type": "must be a number", "literal_error": "must be text parts ({type: text, text})",
            "extra_forbidden": "is not a field here", "missing": "is required"}.get(error["type"], error["msg"])
    if error["type"] in ("int_type", "float_type") and top in ("temperature", "top_p", "min_p", "frequency_penalty",
                                                                "presence_penalty"):
        rule = "must be a number"
    return _bad(path or top, rule, value)


@dataclass
class Params:
    """A checked completions or chat request."""

    prompts: list[list[int]]
    prompt_texts: list[str]
    max_tokens: int
    sampling: Sampling
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool
    trace: bool


def parse_request(body: Any, kind: str, engine: Engine, model_name: str,
                  chat: ChatFormat | None = None) -> Params:
    """The fields of a completions (`kind` "completions") or chat ("chat") request body, checked; chat
    messages become a prompt in `chat`'s format (default: the play template) and end where it says."""
    chat = chat or PlayFormat()
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    fields = BODIES[kind].model_fields
    unknown = sorted(set(body) - set(fields))  # named before pydantic reads them (it cannot name a lone surrogate)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}; this server accepts: {', '.join(sorted(fields))}",
                       param=unknown[0])
    try:
        req = BODIES[kind].model_validate(body)
    except ValidationError as e:
        raise _refusal(e.errors()[0], body) from None
    for name, neutral in _NEUTRAL.items():
        if getattr(req, name, None) is not None and getattr(req, name) not in neutral:
            raise _bad(name, f"is not supported here; leave it out (or {json.dumps(neutral[0])})", body[name])
    if req.model is None:
        raise ApiError(400, f"model is required: {model_name!r} (see GET /v1/models)", param="model")
    if req.model != model_name:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else req.stop
    if len(stop) > MAX_STOPS or not all(stop):
        raise _bad("stop", _RULES["stop"], body.get("stop"))
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise _bad("stream_options", "is only allowed with stream: true", body["stream_options"])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    trace = bool(req.nanollama4_trace)
    if trace and not stream:
        raise _bad("nanollama4_trace", "needs stream: true (the page's stream of steps)", True)

    if kind == "completions":
        texts, prompts = _prompts(req.prompt, engine)
        if trace and len(prompts) > 1:
            raise _bad("nanollama4_trace", "takes one prompt at a time", True)
        logprobs = req.logprobs
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS[kind]:
            raise _bad("logprobs", f"must be an integer from 0 to {MAX_LOGPROBS[kind]} (or null)", logprobs)
        echo = bool(req.echo)
        max_tokens, field = (16 if req.max_tokens is None else req.max_tokens), "max_tokens"
        if max_tokens == 0 and echo and logprobs is not None:
            max_tokens = None  # scoring the prompt alone: allowed, as OpenAI's legacy API allowed it
    else:
        if not req.messages:
            raise _bad("messages", _RULES["messages"], body.get("messages"))
        text = chat_prompt([m.model_dump(exclude_none=True) for m in req.messages], chat)
        prompts = [_encode(text, engine, "messages")]
        texts = [text]
        stop = [*stop, *chat.stop]
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS[kind]:
            raise _bad("top_logprobs", f"must be an integer from 0 to {MAX_LOGPROBS[kind]} (or null)", top)
        if top is not None and not req.logprobs:
            raise _bad("top_logprobs", "needs logprobs: true", top)
        logprobs = (top or 0) if req.logprobs else None
        echo = False
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(req, field)
        if max_tokens is None and len(prompts[0]) < engine.context:
            max_tokens = engine.context - len(prompts[0])  # the rest of the context
        elif max_tokens is None:
            max_tokens = 1  # the check below names the messages as too long
    limit = engine.context
    if max_tokens is None:  # scoring only
        max_tokens = 0
    elif max_tokens < 1:
        raise _bad(field, f"must be a positive integer (at most the context, {limit} tokens, minus the prompt)",
                   max_tokens)
    if len(prompts) > engine.max_batch + engine.max_queue:
        raise ApiError(400, f"{len(prompts)} prompts are more than this server ever holds at once "
                       f"({engine.max_batch} decoding + {engine.max_queue} waiting); send fewer", param="prompt")
    for ids in prompts:
        if len(ids) + max_tokens > limit:
            what = "messages" if kind == "chat" else "prompt"
            raise ApiError(400, f"this model's context is {limit} tokens; the {what} takes {len(ids)} and "
                           f"{field} asks for {max_tokens} more ({len(ids) + max_tokens}); shorten the {what} or "
                           f"lower {field}", param=field if len(ids) < limit else what,
                           code="context_length_exceeded")
    try:
        sampling = Sampling(temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p,
                            top_k=None if req.top_k == -1 else req.top_k, min_p=req.min_p, seed=req.seed,
                            stop=tuple(stop), stop_ids=chat.stop_ids if kind == "chat" else ())
    except SamplingError as e:
        raise ApiError(400, str(e), param=e.field) from None
    return Params(prompts, texts, max_tokens, sampling, stream, include_usage, logprobs, echo, trace)


def _prompts(prompt: Any, engine: Engine) -> tuple[list[str], list[list[int]]]:
    """A completions prompt (its JSON type already checked): a string, a list of strings, a list of token
    ids or a list of such lists."""
    vocab = engine.tokenizer.vocab_size
    if isinstance(prompt, str):
        return [prompt], [_encode(prompt, engine, "prompt")]
    if isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt), [_encode(p, engine, "prompt") for p in prompt]
        lists = [prompt] if all(isinstance(t, int) for t in prompt) else prompt  # one id list, or a list of them
        if all(ids and all(0 <= t < vocab for t in ids) for ids in lists):
            return [engine.tokenizer.decode(ids) for ids in lists], [list(ids) for ids in lists]
    raise _bad("prompt", f"must be a string, a list of up to {MAX_PROMPTS} strings, or token ids in "
               f"[0, {vocab}) (a list, or a list of lists)", prompt)


def _encode(text: str, engine: Engine, param: str) -> list[int]:
    if not text:
        raise ApiError(400, f"the {param} is empty; give some text to continue", param=param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"the {param} holds a lone surrogate (\\ud800-\\udfff), which is not text; send "
                       "valid Unicode", param=param) from None
    try:
        ids = engine.tokenizer.encode(text)
    except TokenizerError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    if not ids:
        raise ApiError(400, f"the {param} encodes to no tokens; give some text to continue", param=param)
    return ids


def chat_prompt(messages: Any, chat: ChatFormat | None = None) -> str:
    """The prompt for chat `messages` (checked: roles system, developer, user, assistant; text content, or
    text parts joined), in `chat`'s format: the play template (`chat.PlayFormat`) unless the served
    checkpoint brought its own (`chat.TemplateFormat`)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {role, content} objects", messages)
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise _bad(f"messages[{i}]", "must be an object with role and content", m)
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise _bad(f"messages[{i}].name", "must be a string", m["name"])
        role, content = m.get("role"), m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content", "may hold only text parts ({type: text, text})", content)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string", content)
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"messages[{i}].role", "must be system, developer, user or assistant", role)
        checked.append({"role": role, "content": content, **({"name": m["name"]} if m.get("name") else {})})
    try:
        return (chat or PlayFormat()).render(checked)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages") from None


# ---------------------------------------------------------------------------------------------- responses
class Session:
    """The requests of one HTTP call (one per prompt) and the events they send back, in order."""

    def __init__(self, engine: Engine, params: Params) -> None:
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def emitter(index: int) -> Callable[[Event], None]:
            def emit(event: Event) -> None:
                try:
                    loop.call_soon_threadsafe(self.events.put_nowait, (index, event))
                except RuntimeError:  # the loop is gone (the server stopped): nobody is listening
                    pass
            return emit

        self.requests = [Request(ids, params.max_tokens, params.sampling, emitter(i), logprobs=params.logprobs,
                                 prompt_logprobs=params.echo and params.logprobs is not None, trace=params.trace)
                         for i, ids in enumerate(params.prompts)]
        self.engine = engine
        self.open = len(self.requests)

    def submit(self) -> None:
        try:
            self.engine.submit_all(self.requests)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}; retry in a moment", kind="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except Closing as e:
            raise ApiError(503, f"{e}; try again once it is back", kind="server_error") from None

    async def __aiter__(self) -> AsyncIterator[tuple[int, Event]]:
        while self.open:
            index, event = await self.events.get()
            if isinstance(event, Finished):
                self.open -= 1
            yield index, event

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()


def _logprob_entry(engine: Engine, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None
                   ) -> tuple[int, float | None, dict[str, float] | None]:
    """(id, its log-probability, the alternatives by name): names are `Engine.token_label`s, which differ
    for tokens of different bytes, so no alternative is lost to a colliding key."""
    label = engine.token_label
    return token_id, logprob, None if top is None else {label[i]: lp for i, lp in top}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(engine: Engine, model_name: str, hosts: HostRule | None = None, origins: Iterable[str] = (),
               chat: ChatFormat | None = None) -> Starlette:
    """The ASGI app: /v1/models, /v1/completions, /v1/chat/completions, /health and the page at /. Chat
    messages are put in `chat`'s format (`chat.chat_format_of`; default the play template).

    Requests pass `guard.Guard` first: a Host that `hosts` allows (default: a server bound to 127.0.0.1),
    an Origin that is the server's own or in `origins`, and JSON bodies declared as such."""
    created = int(time.time())
    page = _page(engine, model_name)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "nanollama4",
            "max_model_len": engine.context}

    async def models(_: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def model(http: HttpRequest) -> Response:
        if http.path_params["name"] != model_name:
            return ApiError(404, f"the model {http.path_params['name']!r} does not exist; this server serves "
                            f"{model_name!r}", param="model", code="model_not_found").response()
        return JSONResponse(card)

    async def health(_: HttpRequest) -> Response:
        decoding, waiting = engine.busy
        state = {"status": "closing" if engine.closing else "ok", "model": model_name, "decoding": decoding,
                 "waiting": waiting, "max_batch": engine.max_batch, "max_queue": engine.max_queue,
                 "finished": dict(engine.finished)}
        return JSONResponse(state, status_code=503 if engine.closing else 200)

    async def index(_: HttpRequest) -> Response:
        return HTMLResponse(page)

    def endpoint(kind: str):
        async def handle(http: HttpRequest) -> Response:
            try:
                body = await _read_json(http)
                params = parse_request(body, kind, engine, model_name, chat)
                session = Session(engine, params)
                session.submit()
            except ApiError as e:
                log.info("refused %s %s: %d %s", http.method, http.url.path, e.status, e.message)
                return e.response()
            except ClientDisconnect:  # nobody is left to answer: one line in the log, not a traceback
                log.info("%s %s: the client left before its request arrived whole", http.method, http.url.path)
                return Response(status_code=400)
            respond = _stream if params.stream else _whole
            return await respond(kind, http, session, params, engine, model_name)
        return handle

    async def not_found(http: HttpRequest, exc: Exception) -> Response:
        return ApiError(404, f"no such endpoint: {http.method} {http.url.path}", kind="not_found_error").response()

    async def not_allowed(http: HttpRequest, exc: Exception) -> Response:
        return ApiError(405, f"{http.method} is not allowed on {http.url.path}").response()

    async def no_icon(_: HttpRequest) -> Response:
        return Response(status_code=204)

    async def failed(http: HttpRequest, exc: Exception) -> Response:
        log.error("%s %s failed: %s: %s", http.method, http.url.path, type(exc).__name__, exc)
        return ApiError(500, "the server failed on this request (its log says why)", kind="server_error").response()

    routes = [Route("/", index), Route("/favicon.ico", no_icon), Route("/health", health), Route("/v1/models", models),
              Route("/v1/models/{name:path}", model),
              Route("/v1/completions", endpoint("completions"), methods=["POST"]),
              Route("/v1/chat/completions", endpoint("chat"), methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed, Exception: failed},
                     middleware=[Middleware(Guard, hosts=hosts or HostRule(), origins=origins)])


async def _read_json(http: HttpRequest) -> Any:
    size = http.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > BODY_LIMIT:
        raise ApiError(413, f"the request body is {int(size):,} bytes; at most {BODY_LIMIT:,} are accepted")
    chunks, total = [], 0
    async for chunk in http.stream():
        total += len(chunk)
        if total > BODY_LIMIT:
            raise ApiError(413, f"the request body is over {BODY_LIMIT:,} bytes; send less")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
        raise ApiError(400, f"the request body is not valid JSON ({reason}); send a JSON object") from None


async def _whole(kind: str, http: HttpRequest, session: Session, params: Params, engine: Engine,
                 model_name: str) -> Response:
    """Wait for every prompt's continuation and answer once; a client that hangs up cancels them."""
    watcher = asyncio.ensure_future(_until_disconnected(http, session))
    texts = [""] * len(session.requests)
    tokens: list[list[TokenEvent]] = [[] for _ in session.requests]
    ends: list[Finished | None] = [None] * len(session.requests)
    try:
        async for index, event in session:
            if isinstance(event, TokenEvent):
                texts[index] += event.text
                tokens[index].append(event)
            else:
                texts[index] += event.text
                ends[index] = event
    finally:
        watcher.cancel()
        session.cancel()
    error = next((e for e in ends if e is not None and e.reason == "error"), None)
    if error is not None:
        return ApiError(500, f"generation failed: {error.error}", kind="server_error").response()
    prompt_n = sum(e.prompt_tokens for e in ends)
    completion_n = sum(e.completion_tokens for e in ends)
    choices = []
    for i, (text, events, end) in enumerate(zip(texts, tokens, ends, strict=True)):
        if kind == "completions":
            prefix = params.prompt_texts[i] if params.echo else ""
            prompt = (params.prompts[i], end.prompt_logprobs, end.prompt_top) if params.echo else None
            logprobs = None if params.logprobs is None else _completion_logprobs(engine, events, prompt)
            choices.append({"index": i, "text": prefix + text, "logprobs": logprobs, "finish_reason": end.reason})
        else:
            logprobs = None if params.logprobs is None else {"content": [_chat_logprob(engine, e) for e in events]}
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                            "finish_reason": end.reason})
    obj = "text_completion" if kind == "completions" else "chat.completion"
    return JSONResponse({"id": _id(kind), "object": obj, "created": int(time.time()), "model": model_name,
                         "choices": choices, "usage": _usage(prompt_n, completion_n)})


async def _until_disconnected(http: HttpRequest, session: Session) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
    session.cancel()


def _completion_logprobs(engine: Engine, events: list[TokenEvent], prompt: tuple | None = None,
                         start: int = 0) -> dict:
    """The completions logprobs object: tokens, their log-probabilities, the top alternatives, offsets into
    the choice's text (from `start`); the prompt's tokens first when it is echoed (`prompt`: its ids,
    log-probabilities and top ones)."""
    entries = [_logprob_entry(engine, e.token_id, e.logprob, e.top) for e in events]
    if prompt is not None:
        ids, prompt_lp, prompt_top = prompt
        prompt_top = prompt_top or [None] * len(ids)
        entries = [_logprob_entry(engine, t, lp, top)
                   for t, lp, top in zip(ids, prompt_lp, prompt_top, strict=True)] + entries
    offsets, at = [], start
    for token_id, _, _ in entries:
        offsets.append(at)
        at += len(engine.token_text[token_id])
    return {"tokens": [engine.token_label[t] for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [top for _, _, top in entries], "text_offset": offsets}


def _chat_logprob(engine: Engine, event: TokenEvent) -> dict:
    label, raw = engine.token_label, engine.token_bytes
    return {"token": label[event.token_id], "logprob": event.logprob, "bytes": list(raw[event.token_id]),
            "top_logprobs": [{"token": label[i], "logprob": lp, "bytes": list(raw[i])} for i, lp in (event.top or [])]}


def _id(kind: str) -> str:
    return f"{'cmpl' if kind == 'completions' else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"


async def _stream(kind: str, http: HttpRequest, session: Session, params: Params, engine: Engine,
                  model_name: str) -> Response:
    """Server-sent events: a chunk per token (per prompt), a last chunk with finish_reason, the usage if
    asked for, then [DONE]. Starlette cancels the generator when the client hangs up."""
    rid, created = _id(kind), int(time.time())
    obj = "text_completion" if kind == "completions" else "chat.completion.chunk"

    def chunk(choices: list[dict], **extra: Any) -> str:
        payload = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices, **extra}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    offsets = [len(t) if params.echo else 0 for t in params.prompt_texts]  # where each choice's next token starts

    async def events() -> AsyncIterator[str]:
        prompt_n = completion_n = 0
        try:
            if kind == "chat":
                for i in range(len(session.requests)):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            elif params.echo:
                for i, text in enumerate(params.prompt_texts):
                    yield chunk([{"index": i, "text": text, "logprobs": None, "finish_reason": None}])
            async for index, event in session:
                if isinstance(event, TokenEvent):
                    choice: dict[str, Any] = {"index": index, "finish_reason": None}
                    if kind == "completions":
                        choice["text"] = event.text
                        choice["logprobs"] = None if params.logprobs is None else _completion_logprobs(
                            engine, [event], start=offsets[index])
                        offsets[index] += len(engine.token_text[event.token_id])
                    else:
                        choice["delta"] = {"content": event.text}
                        choice["logprobs"] = None if params.logprobs is None else {
                            "content": [_chat_logprob(engine, event)]}
                    if event.trace is not None:
                        choice["nanollama4"] = {"token": engine.token_text[event.token_id], "step": event.trace}
                    yield chunk([choice])
                    continue
                prompt_n += event.prompt_tokens
                completion_n += event.completion_tokens
                if event.reason == "error":
                    err = {"message": f"generation failed: {event.error}", "type": "server_error", "param": None,
                           "code": None}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    continue
                last: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": event.reason}
                if kind == "completions":
                    last["text"] = event.text
                else:
                    last["delta"] = {"content": event.text} if event.text else {}
                yield chunk([last])
            if params.include_usage:
                yield chunk([], usage=_usage(prompt_n, completion_n))
            yield "data: [DONE]\n\n"
        finally:
            session.cancel()

    # the background task runs however the response ends, also when the client left before the first event
    return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(session.cancel),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _page(engine: Engine, model_name: str) -> str:
    """The page with this model's layout written into it (the page fetches nothing but the API)."""
    cfg = engine.cfg
    info = {"model": model_name, "max_seq_len": engine.context, "experts_per_token": cfg.experts_per_token,
            "layers": [{"index": i, "kind": "rope" if cfg.uses_rope(i) else "nope", "chunk": cfg.chunk_size(i),
                        "moe": cfg.is_moe(i), "n_experts": cfg.n_experts if cfg.is_moe(i) else 0}
                       for i in range(cfg.n_layers)]}
    html = resources.files("nanollama4.serve").joinpath("page.html").read_text(encoding="utf-8")
    html = palette.fill(html, cfg.n_experts)  # explain's page has the same colours
    blob = json.dumps(info).replace("<", "\\u003c")  # nothing in it can close the script element
    return html.replace("/*MODEL_INFO*/null", blob)
