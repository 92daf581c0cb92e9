"""A tokenize-once cache of a corpus's ids, and batch sampling.

text files (corpus.py) -> token ids, written once to `cache_dir` as a raw binary array (memory-mapped
with numpy) plus a JSON header. The cache is keyed by the text's sha256 and the tokenizer's fingerprint,
so a second run with the same text and tokenizer starts at once, and a change to either makes a new entry.
Batches are random windows drawn from a `torch.Generator`, so they are reproducible from its state
(which a checkpoint can save).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm import tqdm

from ..base.errors import DataError
from ..base.files import atomic_write
from ..model.tokenizer import Tokenizer
from .corpus import empty_corpus, encoded_pieces, find_corpus_files, iter_corpus

Split = Literal["train", "val"]
Batch = tuple[torch.Tensor, torch.Tensor]  # (x, y), each (B, T) int64

def default_cache_dir() -> Path:
    """Where tokenized corpora are cached: $NANOLLAMA4_CACHE if set, else ~/.cache/nanollama4."""
    env = os.environ.get("NANOLLAMA4_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nanollama4"


def windows(tokens: np.ndarray, seq_len: int, batch_size: int = 1) -> Iterator[Batch]:
    """Non-overlapping windows over all of `tokens`, in order: (x, y) batches of `batch_size` full windows
    (b, T), then the final shorter window (1, t) if the tokens do not divide evenly.

    Window k predicts tokens k*T+1 .. k*T+t, so the targets of all windows are tokens[1:], each exactly
    once: summing the cross-entropy over them gives the full loss (the first token has no context).
    """
    n_pred = len(tokens) - 1
    full = max(n_pred, 0) // seq_len
    if full:
        data = torch.from_numpy(np.asarray(tokens[: full * seq_len + 1], dtype=np.int64))
        x_all, y_all = data[:-1].view(full, seq_len), data[1:].view(full, seq_len)
        for i in range(0, full, batch_size):
            yield x_all[i:i + batch_size], y_all[i:i + batch_size]
    if n_pred > full * seq_len:
        tail = torch.from_numpy(np.asarray(tokens[full * seq_len:], dtype=np.int64))
        yield tail[None, :-1], tail[None, 1:]


# ---------------------------------------------------------------------------------------------- the cache


def check_disk_for(files: Sequence[Path], dtype: np.dtype, cache_dir: Path) -> None:
    """Tokenizing writes at most one id per byte of text into the cache: refuse, before reading a byte, a
    corpus whose ids could not fit on the disk that holds the cache."""
    size = sum(Path(f).stat().st_size for f in files)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache_dir).free
    if size * dtype.itemsize > free:
        where = files[0] if len(files) == 1 else Path(files[0]).parent
        raise DataError(f"the corpus at {where} is {size / 2**30:.1f} GiB; its token ids take up to "
                        f"{size * dtype.itemsize / 2**30:.1f} GiB in the cache at {cache_dir} and that disk has "
                        f"{free / 2**30:.1f} GiB free: set NANOLLAMA4_CACHE to a folder on a larger disk")


def _write_ids(files: Sequence[Path], tokenizer: Tokenizer, dtype: np.dtype, path: str,
               invalid_utf8: str, end: int | None = None) -> dict[str, Any]:
    """Tokenize the corpus piece by piece (`encoded_pieces`) into `path` as `dtype` ids, with a progress bar
    in bytes on a terminal: memory holds one piece's ids, however large the corpus; with `end` (an id), each
    file is tokenized alone and followed by it. Returns the count and the sha256 of what was written."""
    digest, n, top = hashlib.sha256(), 0, np.iinfo(dtype).max
    total = sum(Path(f).stat().st_size for f in files)
    documents = [[f] for f in files] if end is not None else [list(files)]
    ending = [("", [end])] if end is not None else []
    pieces = itertools.chain.from_iterable(  # streamed: one piece in memory at a time
        itertools.chain(encoded_pieces(iter_corpus(doc, invalid_utf8), tokenizer), ending) for doc in documents)
    with open(path, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=None,
                                      leave=False) as bar:
        for piece, encoded in pieces:
            ids = np.asarray(encoded, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() > top):
                raise DataError(f"token ids outside [0, {top}] for dtype {dtype.name}; the tokenizer's "
                                "vocab_size does not match its ids")
            data = ids.astype(dtype).tobytes()
            out.write(data)
            digest.update(data)
            n += ids.size
            bar.update(len(piece.encode("utf-8")))
    return {"n_tokens": int(n), "tokens_sha256": digest.hexdigest()}


def _read_header(header_path: Path, bin_path: Path, expected: dict[str, Any]) -> dict[str, Any] | None:
    """The cached header if it matches `expected` and the binary file is exactly the tokens it describes (their
    count and their sha256); else None: a missing, foreign, stale or damaged entry is simply rebuilt."""
    try:
        header = json.loads(header_path.read_text(encoding="utf-8"))
        if not isinstance(header, dict) or any(header.get(k) != v for k, v in expected.items()):
            return None
        n_tokens = header["n_tokens"]
        ok = isinstance(n_tokens, int) and n_tokens > 0
        if ok and bin_path.stat().st_size == n_tokens * np.dtype(header["dtype"]).itemsize \
                and header.get("tokens_sha256") == _sha256_of(bin_path):
            return header
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    return None


def _ids_below(bin_path: Path, dtype: np.dtype, n_tokens: int, vocab_size: int) -> bool:
    return int(np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,)).max()) < vocab_size


def text_digest(files: Sequence[Path], invalid_utf8: str = "error") -> tuple[str, bool]:
    """(sha256, visible) of a corpus's text as `iter_corpus` reads it, piece by piece: the key of its token
    cache and what a run records of its text (train_state.json's corpus_sha256, val_sha256), so that a reader
    can tell it is the same text before tokenizing it (runtext.py); and whether any character is visible."""
    digest, visible = hashlib.sha256(), False
    for piece in iter_corpus(files, invalid_utf8):
        digest.update(piece.encode("utf-8"))
        visible = visible or bool(piece.strip())
    return digest.hexdigest(), visible


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class TokenDataset:
    """A corpus as token ids, split into train (the head) and validation (the last `val_fraction`)."""

    def __init__(self, tokens: np.ndarray, val_fraction: float = 0.1, header: dict[str, Any] | None = None) -> None:
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction ({val_fraction}) must be in [0, 1); 0.1 keeps the last 10% for validation")
        self.tokens = tokens  # (N,) uint16/uint32, usually a read-only memmap
        self.val_fraction = val_fraction
        self.header = header or {}
        self.from_cache = False  # set by build(): True when the cache was reused without tokenizing
        self.val_header: dict[str, Any] | None = None  # a validation text of its own: its header (`with_validation`)
        self.cache_path: Path | None = None
        n = len(tokens)
        self.n_val = int(n * val_fraction)
        self.n_train = n - self.n_val
        self.train_tokens = tokens[: self.n_train]  # views, no copies
        self.val_tokens = tokens[self.n_train:]

    @classmethod
    def build(cls, source: str | Path | Sequence[Path] | None, tokenizer: Tokenizer, cache_dir: str | Path,
              val_fraction: float = 0.1, invalid_utf8: str = "error", documents: bool = False) -> TokenDataset:
        """Tokenize the corpus once into `cache_dir` (or reuse a matching cache entry) and memory-map it.

        `source` is a list of files, or a path / None as for `find_corpus_files`; `invalid_utf8` is as for
        `read_corpus`. `documents`: each file is a document, followed by the tokenizer's end-of-text token
        (a tokenizer without one, saved before it existed, keeps the files joined as they are).
        """
        files = [Path(f) for f in source] if isinstance(source, (list, tuple)) else find_corpus_files(source)
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size < 2**16 else np.uint32)
        cache_dir = Path(cache_dir).expanduser()
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(f"cannot create the cache folder {cache_dir} ({e.strerror}); "
                            "set NANOLLAMA4_CACHE to a writable folder") from e
        check_disk_for(files, dtype, cache_dir)  # before a byte is read: a pass over a huge corpus takes long
        content_sha, visible = text_digest(files, invalid_utf8)  # a first pass: the key, and whether there is text
        if not visible:
            raise empty_corpus(files)
        fingerprint = tokenizer.fingerprint()
        end = getattr(tokenizer, "eos_id", None) if documents else None
        stem = f"tokens-{content_sha[:16]}-{tokenizer.name}-{fingerprint[:16]}{'-documents' if end is not None else ''}"
        bin_path, header_path = cache_dir / f"{stem}.bin", cache_dir / f"{stem}.json"
        expected = {"content_sha256": content_sha, "tokenizer": fingerprint, "dtype": dtype.name,
                    **({"documents": len(files)} if end is not None else {})}

        header = _read_header(header_path, bin_path, expected)
        if header is not None and not _ids_below(bin_path, dtype, header["n_tokens"], tokenizer.vocab_size):
            header = None  # an entry whose checksum agrees but whose ids the tokenizer never made: rebuilt
        from_cache = header is not None
        if header is None:
            written: dict[str, Any] = {}
            # the binary first, then the header: a header on disk always describes a complete binary
            atomic_write(bin_path, lambda p: written.update(_write_ids(files, tokenizer, dtype, p, invalid_utf8, end)))
            if written["n_tokens"] == 0:
                raise DataError(f"the tokenizer produced no tokens for the corpus at {files[0].parent}")
            header = {**expected, **written, "source": [f.name for f in files]}
            atomic_write(header_path, lambda p: Path(p).write_text(json.dumps(header, indent=1), encoding="utf-8"))
        tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(header["n_tokens"],))
        ds = cls(tokens, val_fraction=val_fraction, header=header)
        ds.from_cache, ds.cache_path = from_cache, bin_path
        return ds

    def with_validation(self, other: TokenDataset) -> TokenDataset:
        """This corpus, all of it for training, with `other`'s tokens, all of them, for validation."""
        joined = TokenDataset(self.tokens, val_fraction=0.0, header=self.header)
        joined.val_tokens, joined.n_val = other.tokens, len(other.tokens)
        joined.from_cache, joined.cache_path = self.from_cache, self.cache_path
        joined.val_header = other.header
        return joined

    # ------------------------------------------------------------------------------------------ sampling
    def split_tokens(self, split: Split) -> np.ndarray:
        if split == "train":
            return self.train_tokens
        if split == "val":
            return self.val_tokens
        raise DataError(f"unknown split {split!r}; use 'train' or 'val'")

    def get_batch(self, split: Split, batch_size: int, seq_len: int, generator: torch.Generator) -> Batch:
        """`batch_size` random windows: x = tokens[i:i+T], y = tokens[i+1:i+T+1], int64 (B, T) on the CPU.

        The start indices come from `generator` alone, so saving and restoring its state replays the batches.
        """
        return self.batch_at(split, self.draw_starts(split, batch_size, seq_len, generator), seq_len)

    def draw_starts(self, split: Split, batch_size: int, seq_len: int, generator: torch.Generator) -> list[int]:
        """Where `get_batch`'s windows start: what it draws from `generator`. (Under torchrun every rank draws
        every micro-batch's starts, so that all ranks' generators stay alike, and builds only its own.)"""
        tokens = self._check(split, seq_len, batch_size)
        starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator, device=generator.device)
        return starts.tolist()

    def batch_at(self, split: Split, starts: list[int], seq_len: int) -> Batch:
        """The windows starting at `starts`: x = tokens[i:i+T], y = tokens[i+1:i+T+1]."""
        tokens = self.split_tokens(split)
        windows = np.stack([tokens[i:i + seq_len + 1] for i in starts]).astype(np.int64)  # (B, T+1)
        w = torch.from_numpy(windows)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def fixed_batches(self, split: Split, n_batches: int, batch_size: int, seq_len: int, seed: int) -> list[Batch]:
        """The same `n_batches` batches every time (a fresh generator seeded with `seed`): a cheap, comparable
        validation loss during training."""
        g = torch.Generator().manual_seed(seed)
        return [self.get_batch(split, batch_size, seq_len, g) for _ in range(n_batches)]

    def iter_windows(self, split: Split, seq_len: int, batch_size: int = 1) -> Iterator[Batch]:
        """`windows` over the whole split (the targets are every token but the first, each once)."""
        if seq_len <= 0:
            raise DataError(f"seq_len ({seq_len}) must be positive")
        return windows(self._check(split, 1, 1), seq_len, batch_size)  # two tokens suffice: a context, a target

    def _check(self, split: Split, seq_len: int, batch_size: int) -> np.ndarray:
        if seq_len <= 0 or batch_size <= 0:
            raise DataError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
        tokens = self.split_tokens(split)
        n = len(tokens)
        if n <= seq_len:
            raise DataError(f"the {split} split has {n} tokens, too few for one window of {seq_len}+1; "
                            "use more text or a shorter seq_len")
        return tokens

    def __repr__(self) -> str:
        return f"TokenDataset(n_train={self.n_train}, n_val={self.n_val}, dtype={self.tokens.dtype})"
