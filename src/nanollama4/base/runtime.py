"""Process-level settings: the allocator tuning that makes CPU training faster (applied by the CLI and the
benchmarks), the device a config names, whether bf16 products pay on it (measured, and bf16=auto decided
from that: `choose_precision`), and the memory the machine can still give (what a corpus or a KV cache is
checked against before it is allocated).

glibc serves every allocation above 32 MiB with a fresh mmap and returns it to the OS on free, so a
large-expert model that allocates its expert gradients every step pays the page faults of touching that
memory anew each time. Telling malloc never to use mmap and not to trim the heap keeps freed blocks for
reuse (the MoE layer's step at 128 experts: 136 -> 65 ms, measured 2026-11-29, see git history of
benchmarks/RESULTS.md). Memory is not returned to the OS until exit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import ModelConfig, TrainConfig
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
PAIRS, MIN_PAIRS = 8, 3  # float32/bf16 pairs timed: at most, and at least however long they take
TIMING_BUDGET_S = 0.5  # once spent (a busy machine), no pair past MIN_PAIRS is started
MAX_MACS = 1 << 28  # the timed product's multiply-adds at most: ~18 ms in float32 on one Zen 5 core
_CPUINFO = Path("/proc/cpuinfo")
_NATIVE_BF16 = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512_BF16"))  # the faster first


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The x86 feature flags of /proc/cpuinfo's first `flags` line (or of the text given), None where there
    is none to read (not Linux; not x86: an Arm CPU lists `Features`). torch's `get_cpu_capability()` is
    no help here: it says "AVX512" alike for CPUs with and without bf16 instructions."""
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() == "flags":
            return frozenset(value.split())
    return None


def native_bf16(flags: frozenset[str]) -> str | None:
    """The CPU's bf16 product instructions by the name people know them ("AMX", "AVX512_BF16"), or None."""
    return next((name for flag, name in _NATIVE_BF16 if flag in flags), None)


@dataclass(frozen=True)
class Bf16Choice:
    """What `bf16=auto` decided on a device and what the decision rests on, for the run's one printed line.

    On a CPU whose x86 flags list neither AMX nor AVX512_BF16, float32, untimed: torch emulates bf16 there
    and a noisy timing must not say otherwise. Elsewhere bf16 when float32's best time over bf16's best,
    from interleaved pairs, clears `BF16_PAYS`; with native instructions also when that ratio is at least 1
    and some pair cleared BF16_PAYS: near the bar, where the timing cannot tell, the flag decides.
    """

    chosen: bool
    device: str = "cpu"
    native: str | None = None  # "AMX" or "AVX512_BF16" where the CPU lists them
    emulated: bool = False  # the CPU's flags were read and list neither (nothing timed)
    speedup: float = 0.0  # float32's best time over bf16's best; 0 when nothing was timed
    pairs: int = 0  # float32/bf16 pairs timed
    low: float = 0.0  # the lowest and the highest float32/bf16 ratio within one pair
    high: float = 0.0
    ranks: int = 1  # how many ranks' slowest numbers these are

    @classmethod
    def measured(cls, native: str | None, f32: list[float], bf16: list[float]) -> Bf16Choice:
        """The rule applied to one product's timings, seconds pair by pair (f32[i] just before bf16[i])."""
        ratios = [a / b for a, b in zip(f32, bf16, strict=True)]
        speedup = min(f32) / min(bf16)
        chosen = speedup >= BF16_PAYS or (native is not None and speedup >= 1 and max(ratios) >= BF16_PAYS)
        return cls(chosen, "cpu", native, False, speedup, len(ratios), min(ratios), max(ratios))

    @property
    def flag_decided(self) -> bool:
        """bf16 on the native flag's word: the best ratio fell short of the bar, a pair cleared it."""
        return self.chosen and self.pairs > 0 and self.speedup < BF16_PAYS

    def across(self, max_over_ranks: Callable[[list[float]], list[float]], ranks: int) -> Bf16Choice:
        """The same choice on every rank (every rank calls this): bf16 only where every rank chose it, with
        each number the slowest rank's. `max_over_ranks` is the run's `Parallel.max_over_ranks`."""
        veto, emulated, speedup, low, high, pairs = max_over_ranks(
            [float(not self.chosen), float(self.emulated), -self.speedup, -self.low, -self.high, -self.pairs])
        return replace(self, chosen=not veto, emulated=bool(emulated), speedup=-speedup, low=-low, high=-high,
                       pairs=int(-pairs), ranks=ranks)

    def describe(self) -> str:
        """The run's line: what was measured, how sure, and the choice."""
        then = "bf16 autocast" if self.chosen else "float32"
        if self.device == "cuda":
            return f"bf16=auto: this CUDA GPU {'supports' if self.chosen else 'lacks'} bf16 (not timed) -> {then}"
        if self.device != "cpu":
            return f"bf16=auto: bf16 is not measured on {self.device} -> {then}"
        whose = "this CPU's" if self.ranks == 1 else "a rank's CPU"
        if self.emulated:
            return (f"bf16=auto: neither AMX nor AVX512_BF16 in {whose} flags, so torch would emulate bf16 "
                    f"(not timed) -> {then}")
        basis = f"{self.native} present" if self.native else "no x86 flags to read bf16 support from"
        slowest = "" if self.ranks == 1 else f" on the slowest of {self.ranks} ranks"
        line = (f"bf16=auto: {basis}; bf16 products {self.speedup:.2f}x float32's{slowest} (best of {self.pairs} "
                f"interleaved pairs, pairs ranged {self.low:.2f}x-{self.high:.2f}x)")
        if self.flag_decided:
            line += f", under {BF16_PAYS:g}x but within the pairs' range, so {self.native} decides"
        return f"{line} -> {then}"


def bf16_speedup(device: torch.device, rows: int, d_in: int, d_out: int) -> Bf16Choice:
    """Whether `TrainConfig.bf16 = "auto"` takes bf16 autocast here (`Bf16Choice` has the rule), from the
    CPU's bf16 instructions and how many times faster a training product of this shape (forward and both
    gradients) runs under bf16 autocast than in float32.

    CPUs differ most: with AMX they run several times float32's (benchmarks/RESULTS.md), without bf16
    instructions torch emulates them. The casts and the elementwise work a bf16 step adds are not in the
    product, hence the margin `BF16_PAYS`. The run saves the choice and a resume keeps it, so the
    machine's other work must not make it. Work on every core makes a multi-threaded product wait for its
    preempted threads whatever its precision (two spinning neighbours on two Zen 5 cores: 0.96x, quiet:
    3.1x), so the product runs on one thread and counts that thread's CPU time (3.7x both ways). The
    timings alternate, float32 then bf16, and each side keeps its best, so a burst of load slows both alike
    and is then passed over. A product past `MAX_MACS` is timed on a block of its rows and columns, which
    runs at the ratio of the whole (3.5x and 3.5x on Zen 5 for 8192x256x1536) in a tenth of the time.
    CUDA GPUs that support bf16 count as paying without a timing (their tensor cores); other devices as
    not (autocast's bf16 there is not measured here).
    """
    if device.type == "cuda":
        return Bf16Choice(torch.cuda.is_bf16_supported(), "cuda")
    if device.type != "cpu":
        return Bf16Choice(False, device.type)
    flags = cpu_flags()
    native = native_bf16(flags or frozenset())
    if flags is not None and native is None:
        return Bf16Choice(False, emulated=True)
    rows = min(rows, max(256, MAX_MACS // (d_in * d_out)))
    d_out = min(d_out, max(256, MAX_MACS // (rows * d_in)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Bf16Choice.measured(native, *_interleaved_times(rows, d_in, d_out))
    finally:
        torch.set_num_threads(threads)


def choose_precision(tc: TrainConfig, cfg: ModelConfig, device: torch.device,
                     max_over_ranks: Callable[[list[float]], list[float]], ranks: int = 1, announce: bool = True,
                     speedup: Callable[[torch.device, int, int, int], Bf16Choice] = bf16_speedup) -> TrainConfig:
    """tc with bf16=auto made true or false (any other tc as it is): from the device, and on a CPU its bf16
    instructions and the model's widest product timed at the run's batch (`speedup`, `bf16_speedup`); every
    rank takes bf16 only where every rank chose it (`Bf16Choice.across`; every rank calls this). The choice
    is what the run saves, so a resumed run keeps it. `announce` prints the one line that says why."""
    if tc.bf16 != "auto":
        return tc
    width = max(cfg.ffn_dim if cfg.n_experts == 0 or cfg.moe_every > 1 else 0, cfg.expert_dim,
                cfg.shared_dim if cfg.n_experts and cfg.shared_expert else 0)
    rows = min(tc.batch_size * tc.seq_len, 8192)
    choice = speedup(device, rows, cfg.d_model, 2 * width).across(max_over_ranks, ranks)
    if announce:
        print(choice.describe(), flush=True)
    return tc.replace(bf16=choice.chosen)


def _interleaved_times(rows: int, d_in: int, d_out: int) -> tuple[list[float], list[float]]:
    """CPU seconds per product in float32 and under bf16 autocast, timed in turns after a warm-up of each
    (wall seconds where the thread clock ticks too coarsely to time one: Windows' 16 ms)."""
    clock = time.thread_time if time.get_clock_info("thread_time").resolution <= 1e-6 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_in, generator=g).requires_grad_()
    w = (torch.randn(d_in, d_out, generator=g) * d_in ** -0.5).requires_grad_()

    def seconds(bf16: bool) -> float:
        t = clock()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = x @ w
        y.float().sum().backward()
        elapsed = clock() - t
        x.grad = w.grad = None
        return elapsed

    f32: list[float] = []
    bf16: list[float] = []
    with torch.enable_grad():
        seconds(False), seconds(True)
        start = time.perf_counter()
        while len(f32) < PAIRS and (len(f32) < MIN_PAIRS or time.perf_counter() - start < TIMING_BUDGET_S):
            f32.append(seconds(False))
            bf16.append(seconds(True))
    return f32, bf16
