"""The process of `nanollama4 serve`: bind the socket, run uvicorn over the app, stop cleanly.

SIGTERM and Ctrl-C stop the server gracefully: it stops accepting connections and requests (those still
waiting for a checkpoint's chat template too: `api.create_app`'s `stop_accepting`), lets the streams in
flight finish (cancelling any still open after GRACE seconds), stops the engine and returns, so the
command exits 0.
"""

from __future__ import annotations

import errno
import logging
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable

from ..base.errors import ConfigError
from ..model.tokenizer import Tokenizer
from ..model.transformer import Transformer
from .chat import ChatFormat, PlayFormat
from .guard import MAX_CONNECTIONS, REQUEST_TIMEOUT, HostRule, check_origin, guarded_protocol

GRACE = 30  # seconds in-flight requests get to finish after SIGTERM
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket, or one clear error (a port in use, a host that is not this machine's)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: not an address of this machine ({e.strerror}); use 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        fix = ("pick another --port (0 = any free one) or stop what is using it" if e.errno == errno.EADDRINUSE
               else "give --host an address of this machine (127.0.0.1, or 0.0.0.0 for all)"
               if e.errno == errno.EADDRNOTAVAIL else "pick a port above 1023, or run with the right to bind this one"
               if e.errno == errno.EACCES else "check --host and --port")
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); {fix}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(model: Transformer, tokenizer: Tokenizer, name: str, host: str = "127.0.0.1", port: int = 8000,
          max_batch: int = 16, max_queue: int = 64, announce: Callable[[str], None] = print,
          allowed_hosts: Iterable[str] = (), allow_origins: Iterable[str] = (),
          request_timeout: float = REQUEST_TIMEOUT, max_connections: int | None = None,
          max_context: int | None = None, chat: ChatFormat | None = None,
          stream_interval: float | None = None) -> None:
    """Serve `model` until SIGTERM or Ctrl-C; `announce` gets the address once the socket listens.

    Who may use it (`guard`): Host names as bound plus `allowed_hosts`, page origins in `allow_origins`
    (each `scheme://host[:port]`, checked here so that a mistake stops the command, not the first request);
    each request must arrive whole within `request_timeout` s, and at most `max_connections` are open
    (default: 512, or fewer when the process may open fewer files). `max_context` bounds prompt + answer, at
    most the model's max_seq_len (the engine would cut a larger one down without a word, so it is refused),
    and with it the KV cache allocated up front (refused in one line if it cannot fit). Chat messages take
    `chat`'s format (`chat.chat_format_of`: a checkpoint's own template; default the play template). A stream
    is written at most once every `stream_interval` seconds (default `api.STREAM_INTERVAL`), with the tokens
    that came meanwhile (0: a write per token): each write takes the decoding thread's time (`api.Session`)."""
    try:
        import uvicorn

        from .api import STREAM_INTERVAL, create_app
    except ImportError as e:
        raise ConfigError(f"nanollama4 serve needs starlette and uvicorn ({e.name} is missing): "
                          "pip install 'nanollama4[serve]'") from None
    from .engine import BackgroundEngine, log

    allow_origins = [check_origin(o) for o in allow_origins]
    if max_context is not None and max_context > model.cfg.max_seq_len:
        raise ConfigError(f"--max-context {max_context} is more than this model can use; the largest accepted is "
                          f"its max_seq_len, {model.cfg.max_seq_len}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    sock = bind(host, port)
    if host not in LOCAL_HOSTS:
        print(f"warning: --host {host} makes the server reachable from other machines, and it has no "
              "authentication: anyone who can connect can use it", file=sys.stderr)
    if max_connections is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        max_connections = MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(8, min(MAX_CONNECTIONS, soft - 64))
    engine = BackgroundEngine(model, tokenizer, max_batch=max_batch, max_queue=max_queue,
                              max_context=max_context).start()
    app = create_app(engine, name, HostRule(host, allowed_hosts), allow_origins, chat,
                     STREAM_INTERVAL if stream_interval is None else stream_interval)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACE, lifespan="off",
                            access_log=False, http=guarded_protocol(request_timeout, max_connections))
    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # the signal: new and waiting requests get 503 from now on
            going_on, refused = app.state.stop_accepting()
            if not self.should_exit:
                log.info("stopping: new requests get 503%s; %d in flight have up to %d s to finish",
                         f", as do the {refused} waiting for the chat template" if refused else "", going_on, GRACE)
            super().handle_exit(sig, frame)

    server = Server(config)
    shown_host = f"[{sock.getsockname()[0]}]" if sock.family == socket.AF_INET6 else sock.getsockname()[0]
    address = f"http://{shown_host}:{sock.getsockname()[1]}"
    # uvicorn re-raises the signal that stopped it once it is done; caught here, it ends the command
    # normally (exit 0) rather than as an interruption
    stop_requested = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop_requested.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        announce(f"serving {name!r} at {address} (page: {address}/, API: {address}/v1); Ctrl-C or SIGTERM stops")
        announce((chat or PlayFormat()).describe())
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close(cancel=True, timeout=GRACE)
        if chat is not None:
            chat.close()  # a checkpoint's template process
        sock.close()
