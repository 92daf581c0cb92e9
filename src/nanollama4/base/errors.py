"""The errors meant for people: one base class, one subclass per kind of mistake.

The command line prints a `Nanollama4Error` as one line and exits with status 2; any other exception
is a bug and keeps its traceback. Each subclass also derives from the builtin a caller would expect
(a bad value is a ValueError, a failed run a RuntimeError), so `except ValueError` keeps working.
"""

from __future__ import annotations


class Nanollama4Error(Exception):
    """Base of every error whose message tells a person what to fix."""


class ConfigError(Nanollama4Error, ValueError):
    """A config field, override, preset name or command-line value that is not valid."""


class MissingImport(ConfigError):
    """A kind (a router, an optimizer) defined by code that a config names, which is not imported.

    Those names come from a file, and a run folder may have been downloaded: they are shown with their
    control characters visible (`shown`), and the message says who names them (`message`: "the run folder X
    ... in its train_config.json"), so that nobody is led to --import a path a stranger chose unawares."""

    def __init__(self, field: str, kind: str, modules: str) -> None:
        self.field, self.kind, self.modules = field, kind, modules
        super().__init__(self.message("this config"))

    def message(self, source: str, where: str = "") -> str:
        """The line, naming `source` (and `where` in it the names are written) as the one that names the code."""
        needed = " ".join(f"--import {shown(m)}" for m in self.modules.split(","))
        return (f"{self.field} {self.kind!r} is defined by code that {source} names ({shown(self.modules)}"
                f"{', in ' + where if where else ''}), which is not imported: pass {needed} if you trust that code")


class DataError(Nanollama4Error, ValueError):
    """The corpus cannot be found or read, or is too small for what was asked of it."""


class TokenizerError(Nanollama4Error, ValueError):
    """A tokenizer cannot be built, loaded, or cannot encode/decode the given input."""


class CheckpointError(Nanollama4Error, ValueError):
    """A checkpoint that is missing, corrupt, or describes a model we cannot build."""


class GenerationError(Nanollama4Error, ValueError):
    """Generation settings or a prompt that cannot be used (empty prompt, top_p 0, too long a context)."""


class TrainingError(Nanollama4Error, RuntimeError):
    """A run that cannot continue (non-finite loss, unusable run directory); the message says why."""


class MissingRunFile(Nanollama4Error, FileNotFoundError):
    """A file a run directory should hold (metrics.jsonl) is not there."""


class WriteError(Nanollama4Error, OSError):
    """A file could not be written (a full disk, a read-only folder, a symlink where a file of ours goes);
    whatever was there before is kept."""


def shown(text: str) -> str:
    """`text` read from a file we did not write, safe to print on a terminal: each character that is not
    printable (the ESC of an escape sequence, a newline that would forge a second line, a right-to-left
    override) is written as a Python string literal writes it (\\x1b, \\n, \\u202e), and printable text,
    a path with spaces or accents included, is left as it is, so that a name a person may copy stays whole."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
