"""The server's log: one line per event, whatever a client or a checkpoint wrote into its text.

A model name, a Host header or a chat template's `raise_exception` message reaches the log as its sender
wrote it. Written raw, an escape sequence clears the reader's terminal, a newline forges a line of the
log that looks like the server's own, and a bidirectional override reorders what is shown. So every line
of the server's loggers passes `printable` on its way out (a filter on the logger: no call can forget it),
which escapes such characters and bounds the line; tracebacks, which are the server's own, are kept whole.
"""

from __future__ import annotations

import logging
import re

LOG_CHARS = 2000  # characters of one log line's message, past which it is cut

# What can move a terminal's cursor, end a line or reorder text: C0 and C1 controls and DEL, line and
# paragraph separators, zero-width and bidirectional formatting characters, and lone surrogates (which
# cannot even be written as UTF-8).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ud800-\udfff]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _SHORT.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text: str, limit: int | None = None) -> str:
    """`text` on one line with every control character escaped as Python writes it (`\\x1b`, `\\n`,
    `\\u202e`), and at most `limit` characters of it, saying how many more there were."""
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit:,} more characters cut)"
    return _UNPRINTABLE.sub(_escaped, text)


class Printable(logging.Filter):
    """Makes each record's message `printable` (at most `LOG_CHARS`), before any handler writes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        shown = printable(message, LOG_CHARS)
        if shown != message:
            record.msg, record.args = shown, None
        return True


log = logging.getLogger("nanollama4.serve")
for _name in ("nanollama4.serve", "nanollama4.engine"):  # the engine's lines are the server's too while it serves
    logging.getLogger(_name).addFilter(Printable())
