"""The process that renders a checkpoint's chat template: a Jinja sandbox behind a memory ceiling.

A chat template comes with a downloaded checkpoint, so it is untrusted code: Jinja's sandbox keeps it from
reaching Python's internals, but not from looping for hours or building a string of gigabytes. It therefore
runs here, in processes of their own that `chat.TemplateProcess` starts and feeds: the server's event loop,
its other requests and its signals never wait on a template. This process compiles the template once and
keeps it; conversations are rendered by a `Renderer` forked from it, which is killed past a render's time
limit and replaced by a fresh fork. Compiling a large template takes seconds,
forking takes milliseconds, so a render past its limit costs only its own request. Bounded here, beyond
what the sandbox bounds:

- a render's time (the request's "seconds"): past it the renderer is killed;
- its address space (`RLIMIT_AS`), so a template that builds something huge fails with a MemoryError
  instead of swapping out the server (the compile runs under the same ceiling);
- the size of any string or list an operator builds (`*`, `**`, `+`), checked before it is built; these
  operators are also the ones Jinja would otherwise fold while compiling, so `"a" * 3000000000` costs
  nothing when the template is loaded;
- the size of what a render writes, counted as it is written;
- the length of an error's text (a template's `raise_exception` message can be as long as a render).

It is run as a file (`python -I template_worker.py`), so it imports nothing of nanollama4's and nothing
from the working folder: only the standard library and Jinja. It speaks JSON lines on stdin/stdout: first
{"source", "parent", "paths", "limits"} (answered {"ok": true} or an error), then one {"messages",
"bos_token", "eos_token", "seconds"} per conversation, answered {"text": ...} or {"error": ..., "kind": ...}
(kind "time" when the render ran past its seconds).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import time
from datetime import datetime
from typing import Any


class Refused(Exception):
    """The template's own `raise_exception`, or a value or output over its limit (`kind` says which)."""

    def __init__(self, message: str, kind: str = "refused") -> None:
        super().__init__(message)
        self.kind = kind


def _environment(max_chars: int) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox transformers renders chat templates in, with the operators that build values checked."""

        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_size(operator, left, right, max_chars)
            return super().call_binop(context, operator, left, right)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson  # Jinja's own escapes <, > and & for HTML; templates mean plain JSON
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _check_size(operator: str, left: Any, right: Any, max_chars: int) -> None:
    """Refuse an operation whose result would hold more than `max_chars` items (characters, list items,
    or an integer's digits), before it is computed."""
    size = None
    if operator == "*":
        sized, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(times, int) and hasattr(sized, "__len__"):
            size = len(sized) * max(times, 0)
    elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
        size = len(left) + len(right)
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        size = int(right * abs(left).bit_length() * 0.302) + 1  # decimal digits, about
    if size is not None and size > max_chars:
        raise Refused(f"builds a value of {size:,} items with {operator!r} (at most {max_chars:,})", kind="too_large")


def _raise(message: str) -> None:
    raise Refused(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _end_with(parent: int) -> None:
    """Die with `parent`, even in the middle of a render: Linux sends SIGKILL when the parent goes
    (elsewhere the parent's timeout and the closed pipes end this process)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent went before the request took hold
            os._exit(0)
    except (OSError, AttributeError):
        pass


def _limit_memory(extra: int, final: bool) -> tuple[int, int] | None:
    """At most `extra` bytes of address space beyond what the process holds now (which counts what the
    system maps into every process: a locale archive alone is 200 MB on some systems). `final`: the hard
    limit too, for good; otherwise the soft one only, which this process can lift again (returned: the
    limits to restore). None where there is no such limit or no /proc: the parent's timeout still holds."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        before = resource.getrlimit(resource.RLIMIT_AS)
        hard = before[1]
        ceiling = now + extra if hard == resource.RLIM_INFINITY else min(now + extra, hard)
        resource.setrlimit(resource.RLIMIT_AS, (ceiling, ceiling if final else hard))
        return before
    except (ImportError, ValueError, OSError):
        return None


def _render(template: Any, request: dict[str, Any], max_chars: int) -> str:
    parts, written = [], 0
    for piece in template.generate(messages=request["messages"], add_generation_prompt=True,
                                   bos_token=request.get("bos_token") or "", eos_token=request.get("eos_token") or ""):
        written += len(piece)
        if written > max_chars:
            raise Refused(f"writes more than {max_chars:,} characters", kind="too_large")
        parts.append(piece)
    return "".join(parts)


def _cut(text: str, limit: int) -> str:
    """At most `limit` characters of `text`, saying how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters cut)"


def _answer(work: Any, message_chars: int) -> dict[str, Any]:
    """Run `work`, and say what became of it in the protocol's terms (an error's text at most
    `message_chars` long: it is the template's to write, and goes into an HTTP answer and a log line)."""
    from jinja2 import TemplateError

    try:
        return work()
    except Refused as e:
        reply = {"error": str(e), "kind": e.kind}
    except TemplateError as e:
        reply = {"error": str(e), "kind": "refused"}
    except MemoryError:
        reply = {"error": "needs more memory than a template may take", "kind": "memory"}
    except RecursionError:
        reply = {"error": "recursion too deep", "kind": "refused"}
    except Exception as e:  # a template's expression failed (a TypeError in its own arithmetic, say)
        reply = {"error": f"{type(e).__name__}: {e}", "kind": "refused"}
    reply["error"] = _cut(reply["error"], message_chars)
    return reply


def _line(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply).encode() + b"\n"


class Renderer:
    """A process forked from this one, with the compiled template in it, that renders conversations one
    after another under its own memory ceiling. One that runs past a render's time, runs out of memory or
    fails is killed and replaced by a fresh fork, so a bad render costs its own request and a fork (a few
    milliseconds), never a recompile (seconds for a large template)."""

    def __init__(self, template: Any, max_chars: int, memory: int, message_chars: int) -> None:
        keeper = os.getpid()
        request_in, self.request_out = os.pipe()
        self.answer_in, answer_out = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(self.request_out)
                os.close(self.answer_in)
                quiet = os.open(os.devnull, os.O_RDWR)  # stdin/stdout are the keeper's conversation with the server
                os.dup2(quiet, 0)
                os.dup2(quiet, 1)
                _end_with(keeper)
                _limit_memory(memory, final=True)
                with os.fdopen(request_in, "rb") as requests:
                    for line in requests:
                        def render(line: bytes = line) -> dict[str, Any]:
                            return {"text": _render(template, json.loads(line), max_chars)}

                        _write_all(answer_out, _line(_answer(render, message_chars)))
            finally:
                os._exit(0)
        os.close(request_in)
        os.close(answer_out)

    def render(self, request: bytes, seconds: float, answer_bytes: int) -> tuple[bytes, bool]:
        """The answer line for `request` (a protocol line) within `seconds` and `answer_bytes`, and whether
        this process can render the next one (it rendered this one, or the template refused it)."""
        deadline = time.monotonic() + seconds
        try:
            _write_all(self.request_out, request)
        except OSError:  # the process is gone (killed from outside)
            return _line({"error": "ran out of memory or failed", "kind": "failed"}), False
        answer = _collect(self.answer_in, deadline, seconds, answer_bytes)
        return answer, answer.startswith(b'{"text"') or json.loads(answer).get("kind") == "refused"

    def end(self) -> None:
        """Kill it and reap it (it holds nothing that outlives a render)."""
        for fd in (self.request_out, self.answer_in):
            os.close(fd)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)


def _write_all(fd: int, data: bytes) -> None:
    left = memoryview(data)
    while left:
        left = left[os.write(fd, left):]


def _collect(fd: int, deadline: float, seconds: float, answer_bytes: int) -> bytes:
    """The line a renderer writes into `fd` (it writes nothing more until it is asked again), read by
    `deadline` (`seconds` after the request went) and at most `answer_bytes` long."""
    chunks, size = [b""], 0
    while not chunks[-1].endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return _line({"error": f"took over {seconds:g} s", "kind": "time"})
        chunk = os.read(fd, 1 << 16)
        size += len(chunk)
        if not chunk:  # it died
            return _line({"error": "ran out of memory or failed", "kind": "failed"})
        if size > answer_bytes:
            return _line({"error": "answered more than its limit", "kind": "too_large"})
        chunks.append(chunk)
    return b"".join(chunks)


def main() -> None:
    requests, out = sys.stdin.buffer, sys.stdout.buffer
    setup = json.loads(requests.readline())
    limits = setup["limits"]
    _end_with(int(setup["parent"]))
    sys.path[:0] = setup["paths"]  # where the parent found Jinja (-I leaves out user and environment paths)
    max_chars, memory, message_chars = int(limits["chars"]), int(limits["memory"]), int(limits["message"])
    answer_bytes = 12 * max_chars + 4096  # JSON's escapes: up to 12 bytes a character
    holder: dict[str, Any] = {}

    def compile_it() -> dict[str, Any]:
        try:
            env = _environment(max_chars)
        except ImportError as e:
            return {"error": f"Jinja cannot be imported here ({e})", "kind": "failed"}
        before = _limit_memory(memory, final=False)  # lifted after: this process only forks and relays
        try:
            holder["template"] = env.from_string(setup["source"])
        finally:
            if before is not None:
                import resource

                resource.setrlimit(resource.RLIMIT_AS, before)
        return {"ok": True}

    out.write(_line(_answer(compile_it, message_chars)))
    out.flush()
    if "template" not in holder:
        return
    gc.collect()
    gc.freeze()  # a renderer's collections then leave the template's pages shared with this process, uncopied
    renderer = Renderer(holder["template"], max_chars, memory, message_chars)
    try:
        for line in requests:
            answer, healthy = renderer.render(line, float(json.loads(line)["seconds"]), answer_bytes)
            out.write(answer)
            out.flush()
            if not healthy:  # a fresh one, while the server reads the answer
                renderer.end()
                renderer = Renderer(holder["template"], max_chars, memory, message_chars)
    finally:
        renderer.end()


if __name__ == "__main__":
    main()
