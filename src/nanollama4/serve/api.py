"""The HTTP side of `nanollama4 serve`: OpenAI's completions and chat completions over the engine.

Every request is checked before anything reaches the engine (`schema`: a bad field is answered with the
API's error object naming it, status 400, so a client library raises a clear BadRequestError) and
answered in its endpoint's shape (`reply`). Here: the routes, the bridge between the engine's thread and
the event loop (`Session`), and the page at /. Streams are server-sent events ending in `data: [DONE]`;
a client that goes away cancels its requests, which leave the batch at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..explain import palette
from .chat import ChatFormat, TemplateFormat
from .engine import BackgroundEngine, Closing, Event, Finished, QueueFull, Request, TokenEvent, log
from .guard import Guard, HostRule
from .reply import ChatReply, CompletionReply, Reply, failed
from .schema import BODIES, ApiError, Body, Params, parse_request

BODY_LIMIT = 1 << 20  # bytes of JSON a request may send
ENDPOINTS: dict[str, tuple[type[Body], type[Reply]]] = {"/v1/completions": (BODIES["completions"], CompletionReply),
                                                        "/v1/chat/completions": (BODIES["chat"], ChatReply)}


# Seconds between two writes of a stream. Each write wakes the event loop, which then holds the GIL that the
# decoding thread needs: on a small CPU a write per token slows a fast stream measurably, one per 5 ms far
# less (benchmarks/RESULTS.md, "Serving"), and 5 ms is far below what a reader of a stream can notice.
STREAM_INTERVAL = 0.005


class TemplateQueue:
    """The chat requests that wait for a checkpoint's template. It renders in a process of its own, waited on
    by one thread of this pool, never by the event loop: however long a template takes (up to its limit),
    /health, completions and signals are answered. One renders, up to `max_queue` wait their turn; past
    that a chat request is told to come back (429). Once the server stops accepting (`stop`), those still
    waiting are refused at once (503), as new requests are: only the render under way goes on, within its
    limit, so a stop never waits on a queue of renders."""

    def __init__(self, max_queue: int) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="chat-template")
        self.max_queue = max_queue
        self.jobs: set[Future] = set()  # rendering or waiting
        self.stopped = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Future | None = None  # done once stopped: wakes those waiting

    async def run(self, work: Callable[[], Params]) -> Params:
        """`work()` in its turn on the pool's thread."""
        if self.stopped:
            raise _closing()
        if len(self.jobs) > self.max_queue:
            raise ApiError(429, f"{len(self.jobs)} chat requests wait for the chat template already; retry in a "
                           "moment", kind="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if self.stopping is None:
            self.loop = asyncio.get_running_loop()
            self.stopping = self.loop.create_future()
        job = self.pool.submit(work)
        turn = asyncio.wrap_future(job)
        self.jobs.add(job)
        try:
            await asyncio.wait([turn, self.stopping], return_when=asyncio.FIRST_COMPLETED)
            if not turn.done() and job.cancel():  # stopped before its turn came: it never renders
                raise _closing()
            return await turn
        finally:
            job.cancel()  # (a request cancelled while it waits leaves the queue; a render under way goes on)
            self.jobs.discard(job)

    def stop(self) -> None:
        """Refuse new requests and those waiting (503). Callable from a signal handler: it only sets a flag
        and schedules the wake-up on the event loop."""
        self.stopped = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self.stopping is not None and not self.stopping.done():
            self.stopping.set_result(None)


def _closing() -> ApiError:
    return ApiError(503, "the server is shutting down; try again once it is back", kind="server_error")


class Session:
    """The requests of one HTTP call (one per prompt) and the events they send back, in order.

    The engine's thread appends each event and wakes the event loop only when no wake-up is pending, and
    a stream's tokens that arrive within `interval` seconds of its last write wait for the next one: each
    wake-up and write costs both threads time on the GIL (the engine's step waits for it), so a fast
    stream is written in batches, at most one write per interval, and never more than `interval` late.
    A request's end wakes the loop at once. A whole (unstreamed) answer wakes it only at the end."""

    def __init__(self, engine: BackgroundEngine, params: Params, interval: float = 0.0) -> None:
        loop = asyncio.get_running_loop()
        self.pending: deque[tuple[int, Event]] = deque()  # appended by the engine's thread, taken by the loop
        self.ready = asyncio.Event()
        self.waking = False  # a token's wake-up is on its way, or waiting out the interval (reset as read)
        self.interval = interval if params.stream else math.inf
        self.quiet_until = 0.0 if params.stream else math.inf  # loop time before which a token waits
        self.timer: asyncio.TimerHandle | None = None  # the wake-up of held tokens at quiet_until

        def release() -> None:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.ready.set()

        def wake(urgent: bool) -> None:  # on the loop
            if urgent or loop.time() >= self.quiet_until:
                release()
            elif self.timer is None and self.quiet_until != math.inf:
                self.timer = loop.call_at(self.quiet_until, release)

        def emitter(index: int) -> Callable[[Event], None]:
            def emit(event: Event) -> None:
                self.pending.append((index, event))
                urgent = not isinstance(event, TokenEvent)
                if self.waking and not urgent:
                    return
                self.waking = self.waking or not urgent
                try:
                    loop.call_soon_threadsafe(wake, urgent)
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
        except Closing:
            raise _closing() from None

    async def batches(self) -> AsyncIterator[list[tuple[int, Event]]]:
        """The events in order, as many at a time as have arrived."""
        loop = asyncio.get_running_loop()
        while self.open:
            await self.ready.wait()
            self.ready.clear()
            self.waking = False  # (before taking: a token appended from now on wakes the loop again)
            batch = []
            while self.pending:
                batch.append(self.pending.popleft())
                self.open -= isinstance(batch[-1][1], Finished)
            if batch:
                yield batch
                self.quiet_until = loop.time() + self.interval

    async def __aiter__(self) -> AsyncIterator[tuple[int, Event]]:
        async for batch in self.batches():
            for item in batch:
                yield item

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()


def create_app(engine: BackgroundEngine, model_name: str, hosts: HostRule | None = None, origins: Iterable[str] = (),
               chat: ChatFormat | None = None, stream_interval: float = STREAM_INTERVAL) -> Starlette:
    """The ASGI app: /v1/models, /v1/completions, /v1/chat/completions, /health and the page at /. Chat
    messages are put in `chat`'s format (`chat.chat_format_of`; default the play template). A stream's
    tokens are written at most once every `stream_interval` seconds (those that came meanwhile together).

    Requests pass `guard.Guard` first: a Host that `hosts` allows (default: a server bound to 127.0.0.1),
    an Origin that is the server's own or in `origins`, and JSON bodies declared as such.

    `app.state.stop_accepting()` begins a stop (the server calls it on SIGTERM): every queue refuses from then on."""
    page = _page(engine, model_name)
    # chat requests waiting for a checkpoint's template (the play template renders in place, in microseconds)
    templates = TemplateQueue(engine.max_queue) if isinstance(chat, TemplateFormat) else None

    def stop_accepting() -> tuple[int, int]:
        """The one way the server stops taking work: the engine's queue and the template's refuse new
        requests (503) and the template's refuses those still waiting for it. Callable from a signal handler.
        Gives (requests that go on: in the engine or rendering, requests refused from the template's queue)."""
        decoding, waiting = engine.busy
        queued = len(templates.jobs) if templates is not None else 0
        engine.stop_accepting()
        if templates is not None:
            templates.stop()
        return decoding + waiting + min(queued, 1), max(queued - 1, 0)

    async def health(_: HttpRequest) -> Response:
        decoding, waiting = engine.busy
        state = {"status": "closing" if engine.closing else "ok", "model": model_name, "decoding": decoding,
                 "waiting": waiting, "template_queue": len(templates.jobs) if templates is not None else 0,
                 "max_batch": engine.max_batch, "max_queue": engine.max_queue, "finished": dict(engine.finished)}
        return JSONResponse(state, status_code=503 if engine.closing else 200)

    async def index(_: HttpRequest) -> Response:
        return HTMLResponse(page)

    async def parsed(body: Any, schema: type[Body]) -> Params:
        if templates is None or schema is not BODIES["chat"]:
            return parse_request(body, schema, engine, model_name, chat)
        return await templates.run(lambda: parse_request(body, schema, engine, model_name, chat))

    def endpoint(schema: type[Body], reply: type[Reply]) -> Callable[[HttpRequest], Any]:
        async def handle(http: HttpRequest) -> Response:
            try:
                body = await _read_json(http)
                params = await parsed(body, schema)
                session = Session(engine, params, stream_interval)
                session.submit()
            except ApiError as e:
                log.info("refused %s %s: %d %s", http.method, http.url.path, e.status, e.message)
                return e.response()
            except ClientDisconnect:  # nobody is left to answer: one line in the log, not a traceback
                log.info("%s %s: the client left before its request arrived whole", http.method, http.url.path)
                return Response(status_code=400)
            answer = reply(engine, params, model_name)
            return await _stream(session, answer) if params.stream else await _whole(http, session, answer)
        return handle

    routes = [Route("/", index), Route("/favicon.ico", _no_icon), Route("/health", health),
              *_model_cards(engine, model_name),
              *[Route(path, endpoint(schema, reply), methods=["POST"]) for path, (schema, reply) in ENDPOINTS.items()]]
    app = Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed, Exception: _crashed},
                    middleware=[Middleware(Guard, hosts=hosts or HostRule(), origins=origins)])
    app.state.stop_accepting = stop_accepting
    return app


def _model_cards(engine: BackgroundEngine, model_name: str) -> list[Route]:
    """/v1/models and /v1/models/NAME: the one model this server serves, as OpenAI's API lists one."""
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "nanollama4",
            "max_model_len": engine.context}

    async def models(_: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def model(http: HttpRequest) -> Response:
        if http.path_params["name"] != model_name:
            return ApiError(404, f"the model {http.path_params['name']!r} does not exist; this server serves "
                            f"{model_name!r}", param="model", code="model_not_found").response()
        return JSONResponse(card)

    return [Route("/v1/models", models), Route("/v1/models/{name:path}", model)]


async def _not_found(http: HttpRequest, exc: Exception) -> Response:
    return ApiError(404, f"no such endpoint: {http.method} {http.url.path}", kind="not_found_error").response()


async def _not_allowed(http: HttpRequest, exc: Exception) -> Response:
    return ApiError(405, f"{http.method} is not allowed on {http.url.path}").response()


async def _no_icon(_: HttpRequest) -> Response:
    return Response(status_code=204)


async def _crashed(http: HttpRequest, exc: Exception) -> Response:
    log.error("%s %s failed: %s: %s", http.method, http.url.path, type(exc).__name__, exc)
    return ApiError(500, "the server failed on this request (its log says why)", kind="server_error").response()


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


async def _whole(http: HttpRequest, session: Session, reply: Reply) -> Response:
    """Wait for every prompt's continuation and answer once; a client that hangs up cancels them."""
    watcher = asyncio.ensure_future(_until_disconnected(http, session))
    texts = [""] * len(session.requests)
    tokens: list[list[TokenEvent]] = [[] for _ in session.requests]
    ends: list[Finished | None] = [None] * len(session.requests)
    try:
        async for index, event in session:
            texts[index] += event.text
            if isinstance(event, TokenEvent):
                tokens[index].append(event)
            else:
                ends[index] = event
    finally:
        watcher.cancel()
        session.cancel()
    error = next((e for e in ends if e is not None and e.reason == "error"), None)
    if error is not None:
        return failed(error).response()
    return JSONResponse(reply.whole(texts, tokens, ends))


async def _until_disconnected(http: HttpRequest, session: Session) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
    session.cancel()


async def _stream(session: Session, reply: Reply) -> Response:
    """Server-sent events: a chunk per token (per prompt), a last chunk with finish_reason, the usage if
    asked for, then [DONE]. Starlette cancels the generator when the client hangs up."""

    async def events() -> AsyncIterator[str]:
        prompt_n = completion_n = 0
        try:
            for chunk in reply.opening():
                yield chunk
            async for batch in session.batches():  # one write for the tokens that arrived together
                chunks = []
                for index, event in batch:
                    if isinstance(event, TokenEvent):
                        chunks.append(reply.token(index, event))
                        continue
                    prompt_n += event.prompt_tokens
                    completion_n += event.completion_tokens
                    chunks.append(reply.last(index, event))
                yield "".join(chunks)
            if reply.params.include_usage:
                yield reply.usage(prompt_n, completion_n)
            yield "data: [DONE]\n\n"
        finally:
            session.cancel()

    # the background task runs however the response ends, also when the client left before the first event
    return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(session.cancel),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _page(engine: BackgroundEngine, model_name: str) -> str:
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
