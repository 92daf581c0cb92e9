"""How many CPU threads a training step uses when the run leaves it to us (`TrainConfig.threads = 0`).

All the cores is fastest on a quiet machine, and far the slowest on a busy one: torch's threads split each
operation evenly and then wait at its end for the slowest, so a thread whose core another process holds
makes every one of a step's hundreds of operations wait for the scheduler to hand the core back. On two
cores with one taken by another process, two threads trained at a fifth of one thread's speed
(benchmarks/threads.py, RESULTS.md). Letting idle threads sleep instead of spin (OpenMP's passive wait)
cost a sixth of the quiet speed and still trailed one thread under load, so the count is watched instead:
`ThreadWatch` times a step at the next count down (or back up) now and then, and keeps the faster. Steps
at other counts may differ in their last bits (the order of a sum follows the split), so a run that must
repeat bit for bit sets `threads`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

FIRST_PROBE = 5  # steps before the first probe: the first ones warm caches and allocators up
PROBE_EVERY = 20  # steps between probes after a switch; doubled after each probe that changes nothing
PROBE_EVERY_MOST = 320
FASTER = 0.85  # a probe wins when its step took under this share of the current count's median step


def ladder(most: int) -> list[int]:
    """The counts tried, largest first: all, half, a quarter ... 1."""
    counts = [most]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


@dataclass
class ThreadWatch:
    """Times the training step at its thread count and, every so often, one step at a neighbouring count
    (`ladder`), and moves to the neighbour when that step was clearly faster. `before(step)` sets the count
    for the step about to run; `after(seconds)` records it, and says in words when the count changed."""

    most: int
    counts: list[int] = field(init=False)
    current: int = field(init=False)
    probing: int | None = None
    every: int = PROBE_EVERY
    next_probe: int | None = None  # the step of the next probe: FIRST_PROBE steps after the first one seen
    upward: bool = False  # which neighbour the next probe tries, where both exist
    step: int = 0  # the step `before` was last told of
    recent: deque = field(default_factory=lambda: deque(maxlen=5))

    def __post_init__(self) -> None:
        self.counts = ladder(self.most)
        self.current = self.most
        torch.set_num_threads(self.current)

    def describe(self) -> str:
        if self.most == 1:
            return "threads: 1"
        return (f"threads: {self.most} (all cores), watched: a step slowed by other work on the machine moves to "
                f"fewer (steps at {'/'.join(map(str, self.counts))} threads timed now and then; set threads to fix "
                "the count)")

    def before(self, step: int) -> None:
        if self.next_probe is None:  # a resumed run starts counting where it resumes
            self.next_probe = step + FIRST_PROBE
        self.step = step
        if self.probing is None and step >= self.next_probe and len(self.recent) >= 3 and self.most > 1:
            self.probing = self._neighbour()
            torch.set_num_threads(self.probing)

    def after(self, seconds: float) -> str | None:
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
            self.current, self.every = probe, PROBE_EVERY
            self.recent.clear()
            torch.set_num_threads(probe)
            self.next_probe = self.step + self.every
            return line
        self.every = min(2 * self.every, PROBE_EVERY_MOST)
        self.next_probe = self.step + self.every
        return None

    def _neighbour(self) -> int:
        at = self.counts.index(self.current)
        down = self.counts[at + 1] if at + 1 < len(self.counts) else None
        up = self.counts[at - 1] if at > 0 else None
        self.upward = not self.upward
        if up is not None and (self.upward or down is None):
            return up
        return down if down is not None else self.current
