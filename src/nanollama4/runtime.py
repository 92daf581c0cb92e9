"""Process-level settings: the allocator tuning that makes CPU training faster (applied by the CLI and the
benchmarks), the device a config names, whether bf16 products pay on it (measured), and the memory the
machine can still give (what a corpus or a KV cache is checked against before it is allocated).

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
import time
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


BF16_PAYS = 1.25  # bf16 autocast is chosen when its products run at least this many times float32's speed


def bf16_speedup(device: torch.device, rows: int, d_in: int, d_out: int) -> float:
    """How many times faster a training product of this shape runs under bf16 autocast than in float32 here
    (forward and both gradients, the best of 3 each after a warm-up), for `TrainConfig.bf16 = "auto"`.

    CPUs differ most: with AMX they run several times float32's (benchmarks/RESULTS.md), without bf16
    instructions torch emulates them. The casts and the elementwise work a bf16 step adds are not in
    the product, hence the margin `BF16_PAYS`. CUDA GPUs that support bf16 count as paying without a
    timing (their tensor cores); other devices as not (autocast's bf16 there is not measured here).
    """
    if device.type == "cuda":
        return 2.0 if torch.cuda.is_bf16_supported() else 0.0
    if device.type != "cpu":
        return 0.0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_in, generator=g).requires_grad_()
    w = (torch.randn(d_in, d_out, generator=g) * d_in ** -0.5).requires_grad_()

    def best(bf16: bool) -> float:
        times = []
        for _ in range(4):
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = x @ w
            y.float().sum().backward()
            times.append(time.perf_counter() - t)
        x.grad = w.grad = None
        return min(times[1:])

    with torch.enable_grad():
        return best(False) / best(True)
