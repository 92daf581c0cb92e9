"""File helpers (nanollama4.files): atomic writes that never follow a planted link and fail as one line, and
the readers of files we did not make (bounded JSON, regular files inside their folder, safetensors headers)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from nanollama4.errors import CheckpointError, WriteError
from nanollama4.files import atomic_write, open_owned, read_json, regular_file, safetensors_shapes


def test_atomic_writes_keep_the_file_mode(tmp_path):
    """mkstemp makes private files: a resumed run's metrics.jsonl used to become 0600."""
    from nanollama4.files import atomic_write

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
