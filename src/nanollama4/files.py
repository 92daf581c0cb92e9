"""Writing a file so that a reader, or a crash, never sees half of it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(target: Path, write: Callable[[str], Any]) -> None:
    """Call write(tmp_path) on a temporary file beside `target`, fsync it, then rename it over `target`.

    Readers see the old file or the whole new one, never a truncated one, even if this process is killed
    half way; the temporary file is removed if writing fails.
    """
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    # mkstemp makes the file private (0600); give it the mode the file had, or the usual 0644
    os.chmod(tmp, target.stat().st_mode & 0o777 if target.exists() else 0o644)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
