"""Files in and out: writing so that a reader, or a crash, never sees half of a file, and reading JSON and
safetensors with one clear error for a missing or corrupt file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .errors import CheckpointError


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


def read_json(path: Path) -> Any:
    """The JSON value in `path`; a missing or malformed file is a CheckpointError naming it."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the file is corrupt or truncated") from None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors in a safetensors file (never a pickle); a missing or corrupt file is a CheckpointError."""
    try:
        return load_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); it is corrupt or truncated") from None
