"""Process-level settings: the allocator tuning that makes CPU training faster (applied by the CLI and the
benchmarks), the device a config names, and the memory the machine can still give (what a corpus or a
KV cache is checked against before it is allocated).

glibc serves every allocation above 32 MiB with a fresh mmap and returns it to the OS on free, so a
large-expert model that allocates its expert gradients every step pays the page faults of touching that
memory anew each time. Telling malloc never to use mmap and not to trim the heap keeps freed blocks for
reuse (the MoE layer's step at 128 experts, before and after: benchmarks/RESULTS.md). Memory is not
returned to the OS until exit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

import torch

from .errors import TrainingError

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_applied = False


def tune_allocator() -> bool:
    """Keep large freed blocks in the heap (glibc only; a no-op elsewhere). True when applied."""
    global _applied
    if _applied or not sys.platform.startswith("linux"):
        return _applied
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        _applied = False
    return _applied


def available_memory() -> int | None:
    """Bytes this machine can still give a process (MemAvailable on Linux, else its physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def pick_device(name: str) -> torch.device:
    """The torch device for a TrainConfig.device name, or a TrainingError when this machine lacks it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TrainingError(f"device {name!r} is not available: this torch ({torch.__version__}) sees no CUDA "
                                "GPU; use --set device=cpu (or auto)")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise TrainingError(f"device {name!r} is not available: this machine has {torch.cuda.device_count()} "
                                f"CUDA GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    backend = {"mps": getattr(torch.backends, "mps", None), "xpu": getattr(torch, "xpu", None)}.get(name.split(":")[0])
    if name != "cpu" and not name.startswith("cuda") and (backend is None or not backend.is_available()):
        raise TrainingError(f"device {name!r} is not available on this machine; use --set device=cpu (or auto)")
    return torch.device(name)
