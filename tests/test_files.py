"""File helpers (nanollama4.base.files): atomic writes that never follow a planted link and fail as one line, and
the readers of files we did not make (bounded JSON, regular files inside their folder, safetensors headers)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from nanollama4.base.errors import CheckpointError, WriteError
from nanollama4.base.files import (
    atomic_write,
    json_lines,
    open_owned,
    read_bytes,
    read_json,
    regular_file,
    safetensors_shapes,
)
from tests.helpers import assert_one_line


def test_atomic_writes_keep_the_file_mode(tmp_path):
    """mkstemp makes private files: a resumed run's metrics.jsonl used to become 0600."""
    from nanollama4.base.files import atomic_write

    fresh, kept = tmp_path / "fresh.txt", tmp_path / "kept.txt"
    kept.write_text("old")
    kept.chmod(0o640)
    for path in (fresh, kept):
        atomic_write(path, lambda p: Path(p).write_text("new"))
    assert (fresh.stat().st_mode & 0o777, kept.stat().st_mode & 0o777) == (0o644, 0o640)
    assert kept.read_text() == "new"


# ------------------------------------------------------------------------------------ reading what we did not make
def test_read_json_bounds_size_depth_and_type(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nests its JSON too deeply"):
        read_json(deep, kind=None)
    big = tmp_path / "big.json"
    big.write_text('{"a": "' + "x" * 2000 + '"}')
    with pytest.raises(CheckpointError, match=r"is 2,009 bytes, more than the 1,000"):
        read_json(big, limit=1000)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="holds a JSON list, not the dict expected"):
        read_json(listed)
    assert read_json(listed, kind=list) == [1, 2]
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"a": "caf\xe9"}')
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        read_json(latin)


def test_only_regular_files_inside_the_folder_are_read(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="is not a regular file"):  # opening it would block forever
        read_json(fifo)
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"x")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "link.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="lies outside"):
        regular_file(tmp_path / "ckpt" / "link.safetensors", inside=tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="lies outside"):
        regular_file(tmp_path / "ckpt" / ".." / "elsewhere.safetensors", inside=tmp_path / "ckpt")


@pytest.mark.parametrize("header", [b"\xff" * 8, (10**12).to_bytes(8, "little"), (5).to_bytes(8, "little") + b"[1,2]",
                                    (30).to_bytes(8, "little") + b'{"a": {"shape": [-1], "x": 1}}'])
def test_safetensors_shapes_reads_only_a_checked_header(header, tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(header)
    with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
        safetensors_shapes(path)


# ---------------------------------------------------------------------------------------------- writing
def test_open_owned_refuses_a_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    for mode in ("a", "w"):
        with pytest.raises(WriteError, match="is a symlink; nanollama4 writes only files it made"):
            open_owned(tmp_path / "metrics.jsonl", mode)
    assert victim.read_text() == "keep me"


def test_a_write_that_fails_is_one_line_and_leaves_the_old_file_and_no_debris(tmp_path):
    """Injected ENOSPC (tests/test_checkpoint.py fills a real tmpfs where it runs as root)."""
    target = tmp_path / "page.html"
    target.write_text("old")

    def full(path: str) -> None:
        Path(path).write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(WriteError) as info:
        atomic_write(target, full, hint="make room and try again")
    assert str(info.value) == f"cannot write {target} (no space left on the device); make room and try again"
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]


def test_atomic_writes_of_safetensors_are_not_private(tmp_path):
    """safetensors writes a new file, 0600: checkpoints and exports used to be unreadable to the group."""
    import torch
    from safetensors.torch import save_file

    atomic_write(tmp_path / "m.safetensors", lambda p: save_file({"a": torch.zeros(2)}, p))
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o644


# ------------------------------------------------------------------------------------ bounded readers (issue 55)
def test_read_bytes_refuses_fifos_and_devices_without_blocking_and_bounds_the_size(tmp_path):
    """A config or JSON file we are handed: a FIFO used to block the read forever, a link to /dev/zero to
    read until memory ran out. Both are judged before a byte is read; a plain file is read up to its cap."""
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=r"is not a regular file but a FIFO \(reading it would wait forever\)"):
        read_bytes(fifo, 100)
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="is not a regular file but a device; a config file is a plain file"):
        read_bytes(tmp_path / "zero.toml", 100, "a config file")
    with pytest.raises(CheckpointError, match="is not a regular file but a folder"):
        read_bytes(tmp_path, 100)
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * 101)
    with pytest.raises(CheckpointError, match=r"big.toml is 101 bytes, more than the 100 a config file may be") as e:
        read_bytes(big, 100, "a config file")
    assert_one_line(e.value)
    assert read_bytes(big, 101) == b"#" * 101


def test_read_bytes_takes_memory_for_what_the_file_holds_not_for_its_limit(tmp_path):
    """A run's JSON files are read under a 256 MiB limit; each read of a small one set the whole limit aside."""
    import tracemalloc

    small, larger = tmp_path / "small.json", tmp_path / "larger.json"
    small.write_bytes(b"{}")
    larger.write_bytes(b"x" * (3 << 20))  # a few reads of a MiB, joined
    tracemalloc.start()
    try:
        assert read_bytes(small, 256 << 20) == b"{}"
        assert tracemalloc.get_traced_memory()[1] < 2 << 20
        assert read_bytes(larger, 256 << 20) == b"x" * (3 << 20)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()


def test_read_json_refuses_a_whole_number_too_long_to_be_ours_in_one_line(tmp_path):
    """json.loads raises a plain ValueError (Python's 4,300-digit limit) for such a number: it was a traceback."""
    path = tmp_path / "config.json"
    path.write_text('{"d_model": ' + "9" * 5000 + "}")
    with pytest.raises(CheckpointError, match="holds a whole number of 5,000 digits, which no file of ours holds") as e:
        read_json(path)
    assert_one_line(e.value)


def test_json_lines_skips_lines_not_ours_and_never_holds_a_long_line_whole(tmp_path):
    """metrics.jsonl is a file we may be handed: a 5,000-digit number, NaN, 1e999, deep nesting and a line
    past the limit are each one line that is not ours (None), and an 8 MB line is read in 64 kB pieces
    without ever being held whole."""
    import tracemalloc

    path = tmp_path / "metrics.jsonl"
    long = '{"step": 3, "loss": 1.0, "pad": "' + "x" * 8_000_000 + '"}'
    lines = ['{"step": 1, "loss": 2.5}', '{"step": ' + "1" * 5000 + "}", '{"step": 2, "loss": NaN}',
             '{"step": 2, "loss": 1e999}', "[" * 100_000 + "]" * 100_000, "", long, '{"step": 4, "loss": 1.5}',
             '{"step": 5, "lo']
    path.write_text("\n".join(lines))
    tracemalloc.start()
    try:
        got = list(json_lines(path, limit=2**20, chunk=2**16))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [value for _, value in got] == [{"step": 1, "loss": 2.5}, None, None, None, None, None,
                                           {"step": 4, "loss": 1.5}, None]
    assert got[5][0] == ""  # the long line's text is not kept either
    assert peak < 4 * 2**20, peak
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="is not a regular file but a FIFO"):
        list(json_lines(fifo))
