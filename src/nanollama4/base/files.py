"""Files in and out, for files we did not make as much as for our own.

Writing: a reader, or a crash, never sees half of a file (`atomic_write`, which replaces a symlink at the
target rather than writing through it); a file of ours is never opened through a symlink someone planted
in its place (`open_owned`), nor written in a folder of ours that a planted symlink stands for
(`own_folder`); a failed write (a full disk, a read-only folder) is one `WriteError` naming the file and the
cause, not a traceback.

Reading: anything we load may have been crafted. `regular_file` refuses what is not a plain file (a FIFO
would block forever, /dev/zero never ends); `read_bytes` is the one reader of a small file we are handed (a
config, a JSON file), bounded in size however the file changes under it; `read_json` is the one JSON reader,
bounded in size and nesting and checked for the type of its top-level value; `json_lines` is the one reader
of a JSON-lines file (metrics.jsonl), line by line with each line bounded, so that a 3 GB line is never
held; `safetensors_shapes` reads a safetensors header alone, so that shapes can be checked against a config
before a byte of tensor memory is allocated.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .errors import CheckpointError, ConfigError, Nanollama4Error, WriteError

JSON_LIMIT = 256 * 2**20  # bytes; a BPE tokenizer.json of a 200k vocabulary is ~10 MB
LINE_LIMIT = 16 * 2**20  # bytes of one JSON line; ours are at most ~6 MB (a 256 x 1024 expert-load table)


# ---------------------------------------------------------------------------------------------- writing
def write_cause(e: Exception) -> str:
    """Why a write failed, in words: an OSError's, or the one safetensors wraps in its own error text."""
    if getattr(e, "errno", None) == errno.ENOSPC or "os error 28" in str(e):
        return "no space left on the device"
    return getattr(e, "strerror", None) or str(e)


def write_failed(path: str | os.PathLike[str], e: Exception, hint: str = "") -> WriteError:
    """The one-line error for a write that failed, naming the file and the cause (and what to do)."""
    return WriteError(f"cannot write {path} ({write_cause(e)}){'; ' + hint if hint else ''}")


def atomic_write(target: Path, write: Callable[[str], Any], hint: str = "") -> None:
    """Call write(tmp_path) on a temporary file beside `target`, fsync it, then rename it over `target`.

    Readers see the old file or the whole new one, never a truncated one, even if this process is killed
    half way; the temporary file is removed if writing fails, which is a WriteError (hint: what to do).
    A symlink at `target` is replaced, never written through.
    """
    target = Path(target)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        os.close(fd)
        write(tmp)
        # mkstemp (and safetensors, which writes a new file) make it private (0600); give it the mode the
        # file had, or the usual 0644
        old = os.lstat(target) if os.path.lexists(target) else None
        os.chmod(tmp, stat.S_IMODE(old.st_mode) if old is not None and stat.S_ISREG(old.st_mode) else 0o644)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except (OSError, SafetensorError) as e:  # safetensors reports a failed write (ENOSPC too) as its own error
        raise write_failed(target, e, hint) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def open_owned(path: Path, mode: str = "a") -> IO[str]:
    """Open a file of ours for writing ('w' truncates, 'a' appends) without following a symlink there.

    A link planted where a run keeps its metrics or its lock would otherwise make us truncate or append
    to whatever it points at."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise WriteError(f"{path} is a symlink; nanollama4 writes only files it made: remove the link") from None
        raise write_failed(path, e) from None
    return os.fdopen(fd, mode, encoding="utf-8")


def own_folder(root: Path, *parts: str) -> Path:
    """root/part/..., each folder below `root` made if missing and refused (WriteError) where it is a symlink
    or not a folder: a link planted at RUN/plots would otherwise make us write our files wherever it points.
    `root` itself is the user's choice (a run directory, an --out) and may be reached through links."""
    path = Path(root)
    for part in parts:
        path = path / part
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        except OSError as e:
            raise write_failed(path, e) from None
        if path.is_symlink():
            raise WriteError(f"{path} is a symlink; nanollama4 writes only in folders it made: remove the link "
                             "(what it points at is left alone)")
        if not path.is_dir():
            raise WriteError(f"{path} is not a folder; nanollama4 writes its files there: move it away")
    return path


# ---------------------------------------------------------------------------------------------- reading
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (reading it would wait forever)"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file that is not a regular one is, in words, from its stat mode."""
    return next((word for test, word in _KINDS if test(mode)), "not a plain file")


def regular_file(path: Path, inside: Path | None = None, error: type[Nanollama4Error] = CheckpointError,
                 rule: str = "a checkpoint holds only plain files") -> Path:
    """`path` if it is a regular file (after links) and, when `inside` is given, lies within that folder
    once every link is resolved; otherwise an `error` saying which rule it breaks (`rule`: what the caller
    reads, in words). Judged by stat alone: opening a FIFO blocks, and opening a device may do anything."""
    path = Path(path)
    if inside is not None:
        root = os.path.realpath(inside)
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise error(f"{path} lies outside {inside}; a checkpoint may only name files in its own folder")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except OSError as e:
        raise error(f"cannot read {path} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path} is not a regular file but {kind_of(st.st_mode)}; {rule}")
    return path


def _open_regular(path: Path, error: type[Nanollama4Error], rule: str) -> IO[bytes]:
    """`path` opened for reading if it is a regular file: judged by stat first (`regular_file`), then opened
    without blocking (O_NONBLOCK: a FIFO put there in between does not hang the open) and judged again on
    the open descriptor, which is what will be read."""
    regular_file(path, error=error, rule=rule)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"cannot read {path} ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{path} is not a regular file but {kind_of(mode)}; {rule}")
    return os.fdopen(fd, "rb")


def read_bytes(path: Path, limit: int, what: str = "a file of ours",
               error: type[Nanollama4Error] = CheckpointError) -> bytes:
    """The bytes of the small file at `path` (a config, a JSON file): a regular file of at most `limit` bytes,
    else one `error` naming it (`what`: the file's kind, in words). The read itself stops at `limit` + 1
    bytes, so a file that grows after its size was checked is refused too, never read whole. It reads a MiB at
    a time: `read(limit + 1)` would set aside the whole limit (256 MiB for JSON) for a file of a kilobyte."""
    with _open_regular(path, error, f"{what} is a plain file") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(f"{path} is {size:,} bytes, more than the {limit:,} {what} may be")
        chunks, total = [], 0
        try:
            while total <= limit and (chunk := f.read(min(1 << 20, limit + 1 - total))):
                chunks.append(chunk)
                total += len(chunk)
        except OSError as e:
            raise error(f"cannot read {path} ({e.strerror})") from None
        data = b"".join(chunks)
    if len(data) > limit:
        raise error(f"{path} grew past the {limit:,} bytes {what} may be while it was read")
    return data


class _NotOurs(ValueError):
    """A value no file of ours holds: a NaN or an infinity, or a whole number too long to be one of ours."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # "1e999" parses to inf
        raise _NotOurs(f"non-finite number ({text})")
    return value


def _no_constant(name: str) -> float:
    raise _NotOurs(f"non-finite number ({name})")  # NaN, Infinity, -Infinity: Python's json reads them, JSON has none


def _whole(text: str) -> int:
    """A JSON whole number of at most 40 digits: every count of ours fits, it converts to a finite float, and
    a 5,000-digit one is refused before Python's own limit raises a ValueError of its own."""
    if len(text.lstrip("-")) > 40:
        raise _NotOurs(f"whole number of {len(text.lstrip('-')):,} digits")
    return int(text)


def _loads(text: str) -> Any:
    """json.loads for text we did not write: finite numbers only, whole numbers of at most 40 digits."""
    return json.loads(text, parse_float=_finite, parse_int=_whole, parse_constant=_no_constant)


def read_json(path: Path, kind: type = dict, limit: int = JSON_LIMIT) -> Any:
    """The JSON value in `path`, which must be a `kind` (dict, list; None for any); a missing, oversized,
    too deeply nested, malformed or mistyped file, or one holding a non-finite number (or a whole number of
    more than 40 digits), is one CheckpointError naming it. Non-finite numbers are refused for every file: a
    NaN best validation loss would make every later comparison false and freeze `best` at a stale step, and
    no file of ours ever holds one."""
    data = read_bytes(path, limit, "a JSON file of ours")
    try:
        value = _loads(data.decode("utf-8"))
    except _NotOurs as e:
        raise CheckpointError(f"{path} holds a {e}, which no file of ours holds; the file is corrupt or was "
                              "edited: restore it or use another checkpoint") from None
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} is not valid JSON ({e}); the file is corrupt or truncated") from None
    except RecursionError:
        raise CheckpointError(f"{path} nests its JSON too deeply to be one of our files; it is corrupt") from None
    if kind is not None and not isinstance(value, kind):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not the {kind.__name__} expected")
    return value


def json_lines(path: Path, limit: int = LINE_LIMIT, chunk: int = 2**20) -> Iterator[tuple[str, Any]]:
    """Each non-blank line of a JSON-lines file we did not write (metrics.jsonl), as (its text, its value).

    The value is None for a line that is not JSON we could have written: cut short, edited, not UTF-8
    (read as U+FFFD), holding a non-finite number or a whole number of more than 40 digits, nested too
    deeply, or longer than `limit` bytes; such a line's text is "" when it was too long, which is never
    held whole (the file is read `chunk` bytes at a time). A file that is not a regular one is a
    CheckpointError: a FIFO would block forever, /dev/zero has no end of line."""
    with _open_regular(path, CheckpointError, "a JSON-lines file of ours is a plain file") as f:
        for raw in _bounded_lines(f, limit, chunk):
            if raw is None:
                yield "", None
                continue
            text = raw.decode("utf-8", errors="replace")
            if not text.strip():
                continue
            try:
                yield text, _loads(text)
            except (ValueError, RecursionError):  # json.JSONDecodeError and _NotOurs are ValueErrors
                yield text, None


def _bounded_lines(f: IO[bytes], limit: int, chunk: int) -> Iterator[bytes | None]:
    """The lines of `f` without their "\n", None for one longer than `limit` bytes: at most `limit` + `chunk`
    bytes are held at a time, however long a line is."""
    held, over = bytearray(), False
    while block := f.read(chunk):
        start = 0
        while (end := block.find(b"\n", start)) != -1:
            if over or len(held) + end - start > limit:
                yield None
            else:
                yield bytes(held) + block[start:end]
            held.clear()
            over, start = False, end + 1
        if not over:
            held += block[start:]
            if len(held) > limit:
                held.clear()
                over = True
    if over:
        yield None
    elif held:
        yield bytes(held)


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the file's header alone (safetensors checks the header against the file's
    size and reads no tensor), so a crafted file cannot make us allocate before its shapes are checked."""
    path = regular_file(path)
    try:
        with safe_open(path, framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); it is corrupt or truncated") from None


def read_safetensors(path: Path, inside: Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors in a safetensors file (never a pickle); a missing or corrupt file is a CheckpointError."""
    path = regular_file(path, inside)
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); it is corrupt or truncated") from None


def check_output_target(out: Path, flag: str, ours: Callable[[Path], bool], whose: str, fix: str = "") -> None:
    """Refuse, before any work, an output path (`flag` names the option) that cannot be written, or whose
    present file `ours` does not recognise (`whose`: "a page nanollama4 explain wrote", say): a command
    replaces only what it wrote itself. `ours` must not open a link, a pipe or a device to look."""
    if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise ConfigError(f"{flag} {out}: give a file path in an existing, writable folder")
    if os.path.lexists(out) and not ours(out):
        raise ConfigError(f"{flag} {out} exists and is not {whose}; pick a new file name{fix}")


# ---------------------------------------------------------------------------------------------- exports' temporaries
# The temporary an export writes beside its target (a GGUF file, a transformers folder), .NAME.tmp-PID-XXXXXXXX
# (mkstemp's and mkdtemp's 8 characters): the writer's pid in the name, so that one left by a killed export can
# be told from one being written.
EXPORT_TMP = re.compile(r"\..+\.tmp-(\d{1,10})-[a-z0-9_]{8}")


def hold_lock(fd: int) -> None:
    """Lock the open file or folder `fd` for as long as it stays open (flock: released by the kernel when the
    process ends, however it ends), so that an export's temporary is never taken for one a killed export left;
    where there are no such locks (Windows) the pid in its name alone says."""
    try:
        import fcntl
    except ImportError:
        return
    fcntl.flock(fd, fcntl.LOCK_EX)


def lock_is_free(fd: int) -> bool:
    """Whether no process holds `hold_lock`'s lock on `fd` (it is then ours until `fd` closes)."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def clear_stale_temporaries(folder: Path, opens: int, ours: Callable[[int, os.stat_result], int | None],
                            remove: Callable[[int, str], None], what: str) -> list[str]:
    """Remove the temporaries that exports killed while writing left in `folder`, and say so (a note each).

    An export removes its temporary when it fails, but a SIGKILL, an out-of-memory kill or a power cut skip
    that, and the hidden file or folder, as big as the model, stayed for good. One is removed only when all
    of this holds: its name is one an export gives (`EXPORT_TMP`); the process named in it is gone; it is of
    this user, opened (with `opens`) without following a link; no process holds its lock (`hold_lock`: a live
    export in another container or on another machine, where the pid says nothing, still holds it); and
    `ours(fd, stat)` finds in it only what the export writes, giving its size (None: not ours). `remove(fd,
    path)` then removes it. Anything else is left alone."""
    notes: list[str] = []
    if os.name != "posix":  # no O_NOFOLLOW, no flock: nothing is removed
        return notes
    try:
        entries = [e for e in os.scandir(folder) if EXPORT_TMP.fullmatch(e.name)]
    except OSError:
        return notes
    for entry in entries:
        if pid_alive(int(EXPORT_TMP.fullmatch(entry.name).group(1))):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | opens)
        except OSError:  # a link (ELOOP), the other kind of temporary, gone meanwhile, not ours to read
            continue
        try:
            held = os.fstat(fd)
            if held.st_uid != os.getuid() or not lock_is_free(fd):
                continue
            size = ours(fd, held)
            now = os.lstat(entry.path)
            if size is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):  # replaced since opened
                continue
            remove(fd, entry.path)
            notes.append(f"removed {entry.name} ({size / 2**20:,.1f} MiB), the temporary {what} of an export that "
                         "was killed while writing")
        except OSError:
            continue
        finally:
            os.close(fd)
    return notes


def pid_alive(pid: int) -> bool:
    """Whether process `pid` may still be running here (one we may not signal is running; pid 0 is no writer's
    and names a process group, so it counts as alive: its temporary is left)."""
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
