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

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, Nanollama4Error
from ..files import read_json

ROLE_NAMES = {"user": "USER", "assistant": "ASSISTANT"}  # the play template's speaker names
END_OF_TURN = "\n\n"  # the play template ends each message with a blank line; chat replies stop at one
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")  # where checkpoints keep it


class ChatTemplateError(Nanollama4Error, ValueError):
    """A checkpoint's template refused a conversation (its own `raise_exception`, or a failed expression)."""


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

    def render(self, messages: list[dict[str, Any]]) -> str:
        """messages: checked {role, content: str} objects (`api.chat_prompt` checks them)."""
        parts = [f"{m['content']}{END_OF_TURN}" if m["role"] in ("system", "developer")
                 else f"{ROLE_NAMES[m['role']]}.\n{m['content']}{END_OF_TURN}" for m in messages]
        return "".join(parts) + f"{ROLE_NAMES['assistant']}.\n"

    def describe(self) -> str:
        return "chat: the play template (docs/serve.md); replies end at a blank line"


class TemplateFormat:
    """A checkpoint's Jinja chat template, rendered with `bos_token`/`eos_token` and add_generation_prompt;
    a reply ends at any of `stop_ids` (the checkpoint's end-of-turn and end-of-text tokens)."""

    stop: tuple[str, ...] = ()

    def __init__(self, source: str, where: Path, bos_token: str | None, eos_token: str | None,
                 stop_ids: tuple[int, ...]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson  # Jinja's own escapes <, > and & for HTML; templates mean plain JSON
        env.globals.update(raise_exception=_refuse, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise CheckpointError(f"{where}: the chat template is not valid Jinja ({e}); fix or remove it") from None
        self.where, self.bos_token, self.eos_token, self.stop_ids = where, bos_token, eos_token, stop_ids

    def render(self, messages: list[dict[str, Any]]) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                                        eos_token=self.eos_token or "")
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template ({self.where.name}) refused these messages: {e}"
                                    ) from None

    def describe(self) -> str:
        return f"chat: the checkpoint's template ({self.where.name}); replies end at token ids {list(self.stop_ids)}"


ChatFormat = PlayFormat | TemplateFormat  # what `chat_format_of` gives and the server takes


def _refuse(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
        source, where = (path / "chat_template.jinja").read_text(encoding="utf-8"), path / "chat_template.jinja"
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
    return TemplateFormat(source, where, bos, eos, tuple(i for i in ends if 0 <= i < tokenizer.vocab_size))
