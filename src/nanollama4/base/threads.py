"""How many CPU threads a training step uses when the run leaves it to us (`TrainConfig.threads = 0`).

All the cores is fastest on a quiet machine, and far the slowest on a busy one: torch's threads split each
operation evenly and then wait at its end for the slowest, so a thread whose core another process holds
makes every one of a step's hundreds of operations wait for the scheduler to hand the core back. On two
cores with one taken by another process, two threads trained at a fifth of one thread's speed
(benchmarks/threads.py, RESULTS.md), and at a load of 13 a small fraction of it. Letting idle threads
sleep instead of spin (OpenMP's passive wait) cost a sixth of the quiet speed and still trailed one thread
under load, so the count is watched instead, two ways:

- `Machine` reads how much of the CPUs we may run on other processes used (the kernel's busy time on
  those CPUs less our own CPU time): before the first step (a fifth of a second's look) and over each
  second of the run. Threads beyond the cores they leave free are not started, or are dropped at the end
  of the step that saw them taken, and come back when the cores are free again. This is what makes the
  choice from the first step: under a heavy load one step at the wrong count takes tens of seconds, so
  a choice that waits for a few steps to compare comes minutes late.
- `ThreadWatch` also times a step at the next count down (or back up) now and then, and keeps the faster:
  what the busy time cannot see (a CPU quota, a machine whose /proc says nothing) still moves the count.

Steps at other counts may differ in their last bits (the order of a sum follows the split), so a run that
must repeat bit for bit sets `threads`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

FIRST_PROBE = 5  # steps before the first probe: the first ones warm caches and allocators up
PROBE_EVERY = 20  # steps between probes after a switch; doubled after each probe that changes nothing
PROBE_EVERY_MOST = 320
FASTER = 0.85  # a probe wins when its step took under this share of the current count's median step
START_LOOK = 0.2  # seconds the machine is watched before the first step (the kernel counts CPU time in 10 ms ticks)
WINDOW = 1.0  # seconds of the run over which the other processes' CPU time is read (a tick's error is 1% of it)
SPARE = 0.5  # a count of n threads wants n - SPARE cores free of other work: on 2 cores, other work that holds
# half a core or more on average sends the run to 1 thread (beside a busy loop 2 threads ran at a fifth of 1's speed)


def ladder(most: int) -> list[int]:
    """The counts tried, largest first: all, half, a quarter ... 1."""
    counts = [most]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


class Others(Protocol):
    """How many of our CPUs other processes keep busy (`Machine`; tests give their own)."""

    cpus: int

    def busy(self, at_least: float, wait: bool = False) -> float | None:
        """The CPUs' worth of time other processes used, on average, since the last reading that gave a
        number, once `at_least` seconds have passed since it (waited for when `wait`); else None, the time
        so far counting towards the next reading."""
        ...


class Machine:
    """The CPU time other processes take on the CPUs this process may run on: the kernel's busy time on
    them (/proc/stat, steal included: a hypervisor's other guests are other work too) less our own (this
    process's threads and its finished children). Linux only; elsewhere every reading is None and the
    watch falls back to timing steps."""

    def __init__(self) -> None:
        try:
            self._ours_cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        except (AttributeError, OSError):  # not Linux
            self._ours_cpus = set()
        self.cpus = len(self._ours_cpus) or (os.cpu_count() or 1)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._now()

    def busy(self, at_least: float, wait: bool = False) -> float | None:
        if self._last is None:
            return None
        if wait:
            time.sleep(max(0.0, self._last[0] + at_least - time.perf_counter()))
        elif time.perf_counter() - self._last[0] < at_least:
            return None
        now = self._now()
        if now is None:
            return None
        (t0, busy0, ours0), (t1, busy1, ours1) = self._last, now
        self._last = now
        return max(0.0, (busy1 - busy0) - (ours1 - ours0)) / max(t1 - t0, 1e-9)

    def _now(self) -> tuple[float, float, float] | None:
        """(the clock, the seconds our CPUs were busy, the CPU seconds this process and its children used)."""
        if not self._ours_cpus:
            return None
        import resource

        try:
            with open("/proc/stat", encoding="ascii") as f:
                ticks = 0
                for line in f:
                    name, _, rest = line.partition(" ")
                    if name in self._ours_cpus:
                        v = [int(x) for x in rest.split()]
                        ticks += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
        except (OSError, ValueError, IndexError):
            return None
        own = sum(getattr(resource.getrusage(who), kind) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for kind in ("ru_utime", "ru_stime"))
        return time.perf_counter(), ticks / self._tick, own


def fitting(counts: list[int], free: float) -> int:
    """The largest count of the ladder that `free` cores hold (each thread wants a core, less SPARE), else 1."""
    return next((c for c in counts if c <= free + SPARE), 1)


@dataclass
class ThreadWatch:
    """Keeps the training step's thread count to what the machine gives it. At the start (`__post_init__`)
    and over each WINDOW of the run, `Machine` says how many cores other work holds: the count is capped
    (`ceiling`) at the ladder's largest that the free cores hold, at once. Under that cap, one step at a
    neighbouring count (`ladder`) is timed every so often and the run moves there when that step was
    clearly faster. `before(step)` sets the count for the step about to run; `after(seconds)` records it,
    and says in words when the count changed."""

    most: int
    others: Others | None = None  # None: this machine's (`Machine`)
    counts: list[int] = field(init=False)
    current: int = field(init=False)  # the count steps run at: the chosen one, under the ceiling
    chosen: int = field(init=False)  # what the timed probes chose
    ceiling: int = field(init=False)  # what the cores other work leaves free hold
    held: float = 0.0  # cores other work held at the last reading
    probing: int | None = None
    every: int = PROBE_EVERY
    next_probe: int | None = None  # the step of the next probe: FIRST_PROBE steps after the first one seen
    upward: bool = False  # which neighbour the next probe tries, where both exist
    step: int = 0  # the step `before` was last told of
    recent: deque = field(default_factory=lambda: deque(maxlen=5))

    def __post_init__(self) -> None:
        self.counts = ladder(self.most)
        self.chosen = self.ceiling = self.current = self.most
        if self.most > 1:
            self.others = self.others if self.others is not None else Machine()
            self._judge(self.others.busy(START_LOOK, wait=True))
            self.current = min(self.chosen, self.ceiling)
        torch.set_num_threads(self.current)

    def describe(self) -> str:
        if self.most == 1:
            return "threads: 1"
        watched = (f"watched: a step slowed by other work on the machine moves to fewer (steps at "
                   f"{'/'.join(map(str, self.counts))} threads timed now and then, the cores other processes use "
                   "read every second; set threads to fix the count)")
        if self.current < self.most:
            return (f"threads: {self.current} of {self.most} (other work holds {self.held:.1f} of the "
                    f"{self._cpus()} cores), {watched}")
        return f"threads: {self.most} (all cores), {watched}"

    def before(self, step: int) -> None:
        if self.next_probe is None:  # a resumed run starts counting where it resumes
            self.next_probe = step + FIRST_PROBE
        self.step = step
        if self.probing is None and step >= self.next_probe and len(self.recent) >= 3 and self.most > 1:
            self.probing = self._neighbour()
            if self.probing is not None:
                torch.set_num_threads(self.probing)
            else:  # nothing to try under the ceiling: look again later
                self.next_probe = step + self.every

    def after(self, seconds: float) -> str | None:
        line = self._timed(seconds)
        if self.most > 1 and self.others is not None and self._judge(self.others.busy(WINDOW)):
            return self._settle(line)
        return line

    def _timed(self, seconds: float) -> str | None:
        """Record the step's time; when it was a probe's, keep the probe's count if it was clearly faster."""
        if self.probing is None:
            self.recent.append(seconds)
            return None
        probe, self.probing = self.probing, None
        usual = statistics.median(self.recent)
        torch.set_num_threads(self.current)
        if seconds < FASTER * usual:
            why = "other work shares the cores" if probe < self.current else "the cores are free again"
            line = (f"threads: {self.current} -> {probe} (a step took {seconds:.3g} s at {probe} against "
                    f"{usual:.3g} s at {self.current}: {why})")
            self.chosen = self.current = probe
            self.every = PROBE_EVERY
            self.recent.clear()
            torch.set_num_threads(probe)
            self.next_probe = self.step + self.every
            return line
        self.every = min(2 * self.every, PROBE_EVERY_MOST)
        self.next_probe = self.step + self.every
        return None

    def _judge(self, held: float | None) -> bool:
        """Take a reading of the cores other work held (None: none yet); whether it moved the ceiling."""
        if held is None:
            return False
        self.held = held
        ceiling, self.ceiling = self.ceiling, fitting(self.counts, self._cpus() - held)
        return ceiling != self.ceiling

    def _settle(self, line: str | None) -> str | None:
        """Move to the count the new ceiling allows now, saying why (after what a probe said, if it said)."""
        count = min(self.chosen, self.ceiling)
        if count == self.current:
            return line
        why = (f"other work holds {self.held:.1f} of the {self._cpus()} cores" if count < self.current
               else f"the cores are free again: other work holds {self.held:.1f} of {self._cpus()}")
        moved = f"threads: {self.current} -> {count} ({why})"
        self.current = count
        self.recent.clear()
        torch.set_num_threads(count)
        return moved if line is None else f"{line}\n{moved}"

    def _cpus(self) -> int:
        return self.others.cpus if self.others is not None else self.most

    def _neighbour(self) -> int | None:
        """The count the next probe times: the next one up (under the ceiling) or down, in turns."""
        at = self.counts.index(self.current)
        down = self.counts[at + 1] if at + 1 < len(self.counts) else None
        up = self.counts[at - 1] if at > 0 and self.counts[at - 1] <= self.ceiling else None
        self.upward = not self.upward
        if up is not None and (self.upward or down is None):
            return up
        return down
