"""How chat messages become one prompt, and where a reply ends: our template, or a checkpoint's own.

Our models are base models trained on plays, so `PlayFormat` writes a conversation as a play's scene (each
message under its speaker's name, a blank line after it) and a reply ends at its first blank line. A real
Llama 4 checkpoint comes with its own chat template (a Jinja text in tokenizer_config.json or
chat_template.jinja) and stops at its end-of-turn tokens; `TemplateFormat` renders that template as
transformers' `apply_chat_template(..., add_generation_prompt=True)` does (a sandboxed Jinja with the same
whitespace rules and helpers), so the server sends the model the token ids it was trained to answer.
`chat_format_of(path, tokenizer)` picks the one a folder calls for.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..base.errors import CheckpointError, Nanollama4Error
from ..base.files import read_bytes, read_json
from ..model.tokenizer import Markup, Rendered, break_markup, split_markup
from .logs import printable

ROLE_NAMES = {"user": "USER", "assistant": "ASSISTANT"}  # the play template's speaker names
END_OF_TURN = "\n\n"  # the play template ends each message with a blank line; chat replies stop at one
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")  # where checkpoints keep it
# What a checkpoint's template may cost (it is code from a download): real chat templates render in
# milliseconds, write a few kilobytes and need a few megabytes beyond the interpreter's own.
RENDER_SECONDS = 2.0  # a conversation's render; past it the process rendering it is killed
START_SECONDS = 20.0  # starting the template's process and compiling the template (near 1 MiB: seconds)
ANSWER_GRACE = 5.0  # beyond RENDER_SECONDS, the wait for that process to say so; past it, it is stuck and killed
ERROR_CHARS = 300  # characters of a template's error text (its raise_exception message) a client and the log get
RENDER_CHARS = 1 << 22  # characters a render may write, and items any string or list it builds may hold
RENDER_MEMORY = 256 << 20  # bytes of address space the template's process may take beyond what it had at start
TEMPLATE_CHARS = 1 << 20  # characters of a template's source (real ones: a few thousand)


class ChatTemplateError(Nanollama4Error, ValueError):
    """A checkpoint's template refused a conversation (its own `raise_exception`, or a failed expression)."""


class TemplateLimit(ChatTemplateError):
    """A checkpoint's template was stopped: it ran past `RENDER_SECONDS`, or built more than `RENDER_CHARS`
    or `RENDER_MEMORY` allows. `why` says which, as "the chat template ..." goes on."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"the model's chat template ({name}) {why} and was stopped (docs/serve.md says what a "
                         "template may cost)")
        self.why = why


class PlayFormat:
    """The play template (the server's default): a system message as it is, each other message under its
    speaker's name, a blank line after each, and the assistant's name to end:

        You are terse.

        USER.
        What light through yonder window breaks?

        ASSISTANT.
    """

    stop: tuple[str, ...] = (END_OF_TURN,)  # a reply ends at its first blank line
    stop_ids: tuple[int, ...] = ()

    def render(self, messages: list[dict[str, Any]]) -> Rendered:
        """messages: checked {role, content: str} objects (`api.chat_prompt` checks them). All of it is text:
        the play template has no markup."""
        parts = [f"{m['content']}{END_OF_TURN}" if m["role"] in ("system", "developer")
                 else f"{ROLE_NAMES[m['role']]}.\n{m['content']}{END_OF_TURN}" for m in messages]
        return Rendered(["".join(parts) + f"{ROLE_NAMES['assistant']}.\n"])

    def close(self) -> None:
        """Nothing to stop: the play template renders in the caller's thread, in microseconds."""

    def describe(self) -> str:
        return "chat: the play template (docs/serve.md); replies end at a blank line"


class TemplateFormat:
    """A checkpoint's Jinja chat template, rendered with `bos_token`/`eos_token` and add_generation_prompt;
    a reply ends at any of `stop_ids` (the checkpoint's end-of-turn and end-of-text tokens).

    The template is untrusted code, so it runs in a `TemplateProcess` of its own, within the limits above
    (`RENDER_SECONDS`, `RENDER_CHARS`, `RENDER_MEMORY`). Loading it also renders a one-message conversation,
    so that a template which cannot render even that within its limits stops the command at once, not each
    chat request later.

    `specials` are the spellings of the tokenizer's special tokens. Where the template writes one, it becomes
    the token; where a message's text holds one, it stays text (`render` marks them apart), so that no client
    can end its turn or open a system turn by writing the markup."""

    stop: tuple[str, ...] = ()

    def __init__(self, source: str, where: Path, bos_token: str | None, eos_token: str | None,
                 stop_ids: tuple[int, ...], specials: tuple[str, ...] = ()) -> None:
        self.where, self.bos_token, self.eos_token, self.stop_ids = where, bos_token, eos_token, stop_ids
        self.specials = specials
        if len(source) > TEMPLATE_CHARS:
            raise CheckpointError(f"{where}: the chat template is {len(source):,} characters, more than the "
                                  f"{TEMPLATE_CHARS:,} a template may be; fix or remove it")
        self.process = None
        try:
            self.process = TemplateProcess(source, where)
            self.process.render({"messages": [{"role": "user", "content": "Hello."}], "bos_token": bos_token,
                                 "eos_token": eos_token}, doing="on a one-message conversation")
        except TemplateLimit as e:
            if self.process is not None:
                self.process.close()
            raise CheckpointError(f"{where}: the chat template {e.why} and was stopped, rendering it when it was "
                                  "loaded (docs/serve.md says what a template may cost); fix or remove it") from None
        except ChatTemplateError:  # the template may refuse a conversation it finds too short: its right
            pass

    def render(self, messages: list[dict[str, Any]]) -> Rendered:
        """The prompt for checked `messages`; a `ChatTemplateError` (a `TemplateLimit` past a limit) if the
        template refuses them or cannot render them within its limits.

        A message's text goes to the template with a guard (a random string no message holds) wherever a
        special spelling could start (`break_markup`), so the rendered text's whole spellings are the
        template's own: those become `Markup`, and the guard is taken out of the rest."""
        texts = [str(v) for m in messages for v in m.values()]
        guard = _guard(texts, self.specials)
        shielded = [{k: break_markup(v, self.specials, guard) if k in ("content", "name") else v for k, v in m.items()}
                    for m in messages]
        text = self.process.render({"messages": shielded, "bos_token": self.bos_token, "eos_token": self.eos_token})
        return Rendered(p if isinstance(p, Markup) else p.replace(guard, "") for p in split_markup(text, self.specials))

    def close(self) -> None:
        self.process.close()

    def describe(self) -> str:
        return f"chat: the checkpoint's template ({self.where.name}); replies end at token ids {list(self.stop_ids)}"


class TemplateProcess:
    """The process that holds the compiled template (`template_worker.py`): conversations render in a process
    forked from it, which it kills past `seconds` and replaces by a fresh fork, so a render past its limit
    costs its request and a fork (milliseconds), never a recompile (seconds for a large template). Only if
    the process itself dies or stops answering is it killed, and started again (compiling the template) by
    the next render. Renders take turns (one lock): the server calls `render` from a thread of its own,
    never from its event loop."""

    def __init__(self, source: str, where: Path, seconds: float = RENDER_SECONDS, chars: int = RENDER_CHARS,
                 memory: int = RENDER_MEMORY) -> None:
        self.source, self.where, self.seconds, self.chars, self.memory = source, where, seconds, chars, memory
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.pending = b""
        self._start()  # a template that is not valid Jinja is refused when it is loaded

    def _start(self) -> None:
        import jinja2
        import markupsafe

        # -I: nothing from the working folder or the environment is imported; Jinja's own folders are given
        # (a user site-packages, say, which -I leaves out)
        script = Path(__file__).with_name("template_worker.py")
        paths = sorted({str(Path(m.__file__).parent.parent) for m in (jinja2, markupsafe)})
        self.proc = subprocess.Popen([sys.executable, "-I", str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.pending = b""
        setup = {"source": self.source, "parent": os.getpid(), "paths": paths,
                 "limits": {"chars": self.chars, "memory": self.memory, "message": ERROR_CHARS}}
        reply = self._ask(setup, START_SECONDS, "to load")
        if "error" in reply:
            self._kill()
            what = "is not valid Jinja" if reply.get("kind") == "refused" else "cannot be loaded"
            raise CheckpointError(f"{self.where}: the chat template {what} ({printable(str(reply['error']))}); "
                                  "fix or remove it")

    def render(self, request: dict[str, Any], doing: str = "on these messages") -> str:
        """The template rendered for `request` ({messages, bos_token, eos_token}), within its limits."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            reply = self._ask({**request, "seconds": self.seconds}, self.seconds, doing, grace=ANSWER_GRACE)
        if isinstance(reply.get("text"), str):
            return reply["text"]
        error = str(reply.get("error"))  # at most ERROR_CHARS: the process cuts it
        if reply.get("kind") == "refused":
            raise ChatTemplateError(f"the model's chat template ({self.where.name}) refused these messages: {error}")
        raise TemplateLimit(self.where.name, f"took over {self.seconds:g} s {doing}" if reply.get("kind") == "time"
                            else error)

    def _ask(self, message: dict[str, Any], seconds: float, doing: str, grace: float = 0.0) -> dict[str, Any]:
        """Send one line and wait at most `seconds` (+ `grace`) for the answer; past that, or on any failure on
        the way (so that no answer is left behind for the next request to read), the process is killed."""
        try:
            return self._exchange(message, seconds, doing, grace)
        except BaseException:
            self._kill()
            raise

    def _exchange(self, message: dict[str, Any], seconds: float, doing: str, grace: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        deadline = time.monotonic() + seconds + grace
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            raise TemplateLimit(self.where.name, "ended its process") from None
        fd, limit = self.proc.stdout.fileno(), 12 * self.chars + 4096  # JSON's escapes: up to 12 bytes a character
        chunks, size = [self.pending], len(self.pending)
        with selectors.DefaultSelector() as waiting:
            waiting.register(fd, selectors.EVENT_READ)
            while b"\n" not in chunks[-1]:
                left = deadline - time.monotonic()
                ready = left > 0 and bool(waiting.select(left))
                chunk = os.read(fd, 1 << 16) if ready else b""
                if not chunk or size > limit:
                    raise TemplateLimit(self.where.name, f"took over {seconds:g} s {doing}" if not ready
                                        else "answered more than its limit" if chunk else "ran out of memory or failed")
                chunks.append(chunk)
                size += len(chunk)
        line, _, self.pending = b"".join(chunks).partition(b"\n")
        reply = json.loads(line)
        return reply if isinstance(reply, dict) else {"error": "an answer not of the protocol", "kind": "failed"}

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self.proc = None

    def close(self) -> None:
        """Stop the process (the server does when it stops; a process left behind also ends with its parent).
        Its end of input first: it then reaps its renderer and exits, leaving no zombie where nothing reaps."""
        with self.lock:
            if self.proc is not None and self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(1)
            self._kill()


ChatFormat = PlayFormat | TemplateFormat  # what `chat_format_of` gives and the server takes


def _guard(texts: list[str], specials: tuple[str, ...]) -> str:
    """A string that none of `texts` or `specials` holds: private-use delimiters around random digits (digits,
    so that a template's upper() or lower() leaves it whole)."""
    while True:
        guard = f"\ue000{secrets.randbelow(10**16):016d}\ue001"
        if not any(guard in t for t in (*texts, *specials)):
            return guard



def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def chat_format_of(path: str | Path, tokenizer: Any) -> ChatFormat:
    """The chat format a model folder calls for: its own template where a transformers folder has one
    (chat_template.jinja, then tokenizer_config.json's `chat_template`, then chat_template.json), with its
    BOS/EOS texts and its end ids (generation_config.json's eos_token_id, else config.json's, and the EOS
    token's own id); the play template for our runs and for folders without one."""
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        return PlayFormat()
    source, where = None, None
    if (path / "chat_template.jinja").is_file():
        where = path / "chat_template.jinja"
        try:
            source = read_bytes(where, 4 * TEMPLATE_CHARS, "a chat template").decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{where}: the chat template is not UTF-8 text; fix or remove it") from None
    config = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    if source is None and config.get("chat_template") is not None:
        source, where = config["chat_template"], path / "tokenizer_config.json"
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
    if source is None and (path / "chat_template.json").is_file():
        source, where = read_json(path / "chat_template.json").get("chat_template"), path / "chat_template.json"
    if source is None:
        return PlayFormat()
    if not isinstance(source, str):
        raise CheckpointError(f"{where}: chat_template is not a text; fix or remove it")
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    ends = []
    for name in ("generation_config.json", "config.json"):
        if (path / name).is_file() and not ends:
            ends = _ids(read_json(path / name).get("eos_token_id"))
    inner = getattr(tokenizer, "tokenizer", None)  # a BPETokenizer's `tokenizers.Tokenizer`
    eos_id = inner.token_to_id(eos) if eos is not None and hasattr(inner, "token_to_id") else None
    if eos_id is not None and eos_id not in ends:
        ends.append(eos_id)
    specials = tuple(getattr(tokenizer, "special_tokens", {}))
    return TemplateFormat(source, where, bos, eos, tuple(i for i in ends if 0 <= i < tokenizer.vocab_size), specials)
