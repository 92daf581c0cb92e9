"""File helpers (nanollama4.files): atomic writes."""

from __future__ import annotations

from pathlib import Path


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
