"""The process that renders a checkpoint's chat template: a Jinja sandbox behind a memory ceiling.

A chat template comes with a downloaded checkpoint, so it is untrusted code: Jinja's sandbox keeps it from
reaching Python's internals, but not from looping for hours or building a string of gigabytes. It therefore
runs here, in a process of its own that `chat.TemplateProcess` starts, feeds and, past its time limit,
kills: the server's event loop, its other requests and its signals never wait on a template. This process
bounds what the sandbox does not:

- its address space (`RLIMIT_AS`), so a template that builds something huge fails with a MemoryError here
  instead of swapping out the server;
- the size of any string or list an operator builds (`*`, `**`, `+`), checked before it is built; these
  operators are also the ones Jinja would otherwise fold while compiling, so `"a" * 3000000000` costs
  nothing when the template is loaded;
- the size of what a render writes, counted as it is written.

It is run as a file (`python -I template_worker.py`), so it imports nothing of nanollama4's and nothing
from the working folder: only the standard library and Jinja. It speaks JSON lines on stdin/stdout: first
{"source", "limits"} (answered {"ok": true} or an error), then one {"messages", "bos_token",
"eos_token"} per conversation, answered {"text": ...} or {"error": ..., "kind": ...}.
"""

from __future__ import annotations

import json
import sys
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
    """Die with the server, even in the middle of a render: Linux sends SIGKILL when the parent goes
    (elsewhere the parent's timeout and the closed stdin end this process)."""
    try:
        import ctypes
        import os
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent went before the request took hold
            os._exit(0)
    except (OSError, AttributeError):
        pass


def _limit_memory(extra: int) -> None:
    """At most `extra` bytes of address space beyond what the process holds now (which counts what the
    system maps into every process: a locale archive alone is 200 MB on some systems)."""
    try:
        import os
        import resource

        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (now + extra, now + extra))
    except (ImportError, ValueError, OSError):  # no such limit or /proc here: the parent's timeout still holds
        pass


def _render(template: Any, request: dict[str, Any], max_chars: int) -> str:
    parts, written = [], 0
    for piece in template.generate(messages=request["messages"], add_generation_prompt=True,
                                   bos_token=request.get("bos_token") or "", eos_token=request.get("eos_token") or ""):
        written += len(piece)
        if written > max_chars:
            raise Refused(f"writes more than {max_chars:,} characters", kind="too_large")
        parts.append(piece)
    return "".join(parts)


def _answer(work: Any) -> dict[str, Any]:
    """Run `work`, and say what became of it in the protocol's terms."""
    from jinja2 import TemplateError

    try:
        return work()
    except Refused as e:
        return {"error": str(e), "kind": e.kind}
    except TemplateError as e:
        return {"error": str(e), "kind": "refused"}
    except MemoryError:
        return {"error": "needs more memory than a template may take", "kind": "memory"}
    except RecursionError:
        return {"error": "recursion too deep", "kind": "refused"}
    except Exception as e:  # a template's expression failed (a TypeError in its own arithmetic, say)
        return {"error": f"{type(e).__name__}: {e}", "kind": "refused"}


def main() -> None:
    send = sys.stdout.write
    setup = json.loads(sys.stdin.readline())
    limits = setup["limits"]
    _end_with(int(setup["parent"]))
    sys.path[:0] = setup["paths"]  # where the parent found Jinja (-I leaves out user and environment paths)
    max_chars = int(limits["chars"])
    holder: dict[str, Any] = {}

    def compile_it() -> dict[str, Any]:
        try:
            env = _environment(max_chars)
        except ImportError as e:
            return {"error": f"Jinja cannot be imported here ({e})", "kind": "failed"}
        _limit_memory(int(limits["memory"]))
        holder["template"] = env.from_string(setup["source"])
        return {"ok": True}

    reply = _answer(compile_it)
    send(json.dumps(reply) + "\n")
    sys.stdout.flush()
    if "template" not in holder:
        return
    for line in sys.stdin:
        request = json.loads(line)
        reply = _answer(lambda r=request: {"text": _render(holder["template"], r, max_chars)})
        send(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
