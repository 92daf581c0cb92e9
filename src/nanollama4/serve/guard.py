"""Who may use the server, and for how long a connection may keep it waiting.

A model server on 127.0.0.1 is still reachable by every web page the user opens: a page cannot read a
cross-origin answer, but it can send "simple" requests (a form or text/plain POST, no preflight), and a
DNS-rebinding page (its own name re-pointed at 127.0.0.1) is same-origin with the server and reads
everything. So, per request (`Guard`, an ASGI middleware):
- `Host`, `Origin` and `Content-Type` may each be sent once (400 else): with a repeat, the copy a rule reads
  need not be the one that decides what the request does;
- the `Host` header must name the server as it was bound (`allowed_hosts`), or a name given with
  --allowed-host: a rebinding page sends its own name and is refused (400);
- a browser's `Origin` must be the server's own (its page) or one given with --allow-origin (403 else); CORS
  preflights are answered for those origins only. An allowed origin is `scheme://host[:port]`, and never `*`;
- a POST body must be declared `application/json` (415 else), which no page can send cross-origin without a
  preflight.

Per connection (`guarded_protocol`, uvicorn's HTTP/1.1 protocol with two limits): each request it carries,
pipelined ones included, must arrive whole within `request_timeout` seconds of the connection starting to
wait for it, or the connection is closed; and past `max_connections` open connections a new one is answered
503 and closed at once; so idle half-sent requests cannot exhaust the process's descriptors.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
from collections.abc import Iterable
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..base.errors import ConfigError
from .logs import log

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
REQUEST_TIMEOUT = 20.0  # seconds for a request's headers and body to arrive
MAX_CONNECTIONS = 512
ONCE = {"host": "Host", "origin": "Origin", "content-type": "Content-Type"}  # headers a request may send once


def host_name(header: str) -> str:
    """The name part of a Host header ("[::1]:8000" -> "::1", "localhost:8000" -> "localhost"), lowercased;
    "" for a bracketed one that is not `[addr]` or `[addr]:PORT`, so that no allowed name matches it."""
    header = header.strip().lower()
    if header.startswith("["):
        name, bracket, rest = header[1:].partition("]")
        return name if bracket and (not rest or rest[0] == ":" and rest[1:].isdigit()) else ""
    name, colon, port = header.rpartition(":")
    return name if colon and port.isdigit() and ":" not in name else header


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostRule:
    """The Host names a server bound to `bind_host` answers to: loopback names when bound to loopback; the
    address itself and this machine's name when bound to one address; any IP literal and the machine's
    name when bound to all (an IP literal cannot be rebound); and each of `extra` in every case."""

    def __init__(self, bind_host: str = "127.0.0.1", extra: Iterable[str] = ()) -> None:
        bind_host = host_name(bind_host)
        loopback = bind_host in LOOPBACK_NAMES or (_is_ip(bind_host) and ipaddress.ip_address(bind_host).is_loopback)
        self.any_ip = bind_host in WILDCARDS
        names = set(LOOPBACK_NAMES)
        if not loopback:
            names |= {bind_host, socket.gethostname().lower(), socket.getfqdn().lower()}
        self.names = frozenset(names - set(WILDCARDS)) | {host_name(n) for n in extra} - {""}

    def allows(self, header: str | None) -> bool:
        name = host_name(header or "")
        return bool(name) and (name in self.names or (self.any_ip and _is_ip(name)))

    def describe(self) -> str:
        shown = sorted(self.names)
        return ", ".join(shown) + (", or any IP address" if self.any_ip else "")


def check_origin(origin: str) -> str:
    """`origin` as a browser sends it (lowercased, no trailing slash), or a ConfigError in one line: a page is
    allowed by naming its origin exactly, so anything else would never match, or (`*`) match every page."""
    if origin.strip() == "*":
        raise ConfigError("--allow-origin '*' would let every web page the user opens use the server; name the "
                          "page's origin instead (e.g. --allow-origin http://localhost:3000)")
    normal = origin.strip().lower().removesuffix("/")
    if not _is_origin(normal):
        raise ConfigError(f"--allow-origin {origin!r} is not an origin: give scheme://host[:port], with scheme http "
                          "or https and no path (e.g. http://localhost:3000)")
    return normal


def _is_origin(text: str) -> bool:
    try:
        parts = urlsplit(text)
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number, an unclosed bracket
        return False
    if parts.scheme not in ("http", "https") or not host or not text.isprintable() or " " in text:
        return False
    netloc = (f"[{host}]" if ":" in host else host) + ("" if port is None else f":{port}")
    return text == f"{parts.scheme}://{netloc}"  # nothing else: no user, path, query or fragment


class Guard:
    """ASGI middleware: the Host, Origin and content-type rules of the module docstring."""

    def __init__(self, app, hosts: HostRule, origins: Iterable[str] = ()) -> None:
        self.app, self.hosts = app, hosts
        self.origins = frozenset(check_origin(o) for o in origins)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        names = [k.decode("latin-1") for k, _ in scope["headers"]]
        for name, shown in ONCE.items():
            if names.count(name) > 1:
                return await _refuse(send, 400, f"the {shown} header is sent {names.count(name)} times; a request "
                                     "may send it once", name)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host, origin = headers.get("host"), headers.get("origin")
        if not self.hosts.allows(host):
            return await _refuse(send, 400, f"the Host header {host!r} is not a name this server answers to "
                                 f"({self.hosts.describe()}); to reach it by that name, start it with "
                                 f"--allowed-host {host_name(host or '') or 'NAME'}", "host")
        own = origin is not None and origin.lower() == f"{scope['scheme']}://{host}".lower()
        listed = origin is not None and origin.rstrip("/").lower() in self.origins
        if scope["method"] == "OPTIONS" and origin is not None:  # a CORS preflight: for the origins allowed only
            if not listed:
                return await _refuse(send, 403, f"cross-origin requests from {origin!r} are not allowed; start the "
                                     "server with --allow-origin ORIGIN to allow a page's origin", "origin")
            return await _preflight(send, origin)
        if origin is not None and not own and not listed:
            return await _refuse(send, 403, f"requests from the web page at {origin!r} are not allowed; start the "
                                 f"server with --allow-origin {origin} to allow that page", "origin")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return await _refuse(send, 415, f"the body must be sent as Content-Type: application/json, not "
                                     f"{kind or 'none'!r}", "content-type")
        if not listed:
            return await self.app(scope, receive, send)

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
            await send(message)

        return await self.app(scope, receive, send_with_cors)


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _preflight(send, origin: str) -> None:
    headers = [*_cors_headers(origin), (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
               (b"access-control-allow-headers", b"authorization, content-type"),
               (b"access-control-max-age", b"600"), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def _error(message: str, kind: str, param: str | None) -> bytes:
    """The body of an OpenAI-style error object."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": None}}).encode()


async def _refuse(send, status: int, message: str, param: str) -> None:
    """An OpenAI-style error object, logged in one line."""
    log.info("refused: %d %s", status, message)
    body = _error(message, "invalid_request_error" if status != 403 else "permission_error", param)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def guarded_protocol(request_timeout: float = REQUEST_TIMEOUT, max_connections: int = MAX_CONNECTIONS) -> type:
    """uvicorn's H11Protocol with a deadline on each request's arrival and a bound on open connections."""

    body = _error(f"the server has {max_connections} connections open, its most; try again shortly", "server_error",
                  None)
    busy = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    class GuardedH11Protocol(H11Protocol):
        _arrival = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("refused a connection: %d are open, the most allowed", max_connections)
                transport.write(busy)
                transport.close()
                return
            self._arm()
            self.conn.start_next_cycle = self._timed(self.conn.start_next_cycle)  # type: ignore[method-assign]

        def _timed(self, start_next_cycle):
            """h11's start of the wait for the next request, with that request's deadline armed. It runs after
            a response (uvicorn's on_response_complete) or, when a body ends after its answer, in
            handle_events; either then parses a pipelined request from the buffer, with no data_received."""

            def timed() -> None:
                start_next_cycle()
                self._arm()

            return timed

        def _arm(self) -> None:
            self._disarm()
            self._arrival = self.loop.call_later(request_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._arrival is not None:
                self._arrival.cancel()
                self._arrival = None

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):  # arrived whole (or the connection ended)
                self._disarm()

        def _too_slow(self) -> None:
            self._arrival = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                log.info("closed a connection from %s: its request had not arrived whole after %g s",
                         "{}:{}".format(*self.client) if self.client else "a client", request_timeout)
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """An OpenAI-style error object saying what h11 found wrong ("Found multiple Host: headers"), in
            place of uvicorn's plain "Invalid HTTP request received."; uvicorn calls this while handling
            h11's error."""
            reason = str(sys.exc_info()[1] or msg)
            log.info("refused: 400 %s", reason)
            body = _error(f"not a valid HTTP/1.1 request: {reason}", "invalid_request_error",
                          "host" if "Host:" in reason else None)
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol
