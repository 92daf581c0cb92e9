"""bf16=auto's decision (runtime.bf16_speedup, Bf16Choice): neither a neighbour's burst of load nor steady
work on every core flips it, a CPU without bf16 instructions takes float32 untimed, the rule near the bar,
the printed line, and the same answer on every rank."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import nanollama4.base.runtime as runtime
from nanollama4.base.runtime import Bf16Choice, bf16_speedup, cpu_flags, native_bf16

ZEN5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"


class FakeClock:
    """`time` for a CPU where a product's work takes 3 ms in float32 and 1 ms under bf16 (3x). A neighbour's
    burst makes the products numbered in `busy` (1-based, counting warm-ups) 3 times slower, on the thread's
    clock as well (the caches and the memory are shared); steady work on every core adds `wait` wall
    seconds to each product, time its thread spends preempted."""

    def __init__(self, busy: set[int], wait: float = 0.0) -> None:
        self.wall = self.cpu = 0.0
        self.products, self.busy, self.wait = 0, busy, wait

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu

    def get_clock_info(self, name: str):
        return time.get_clock_info(name)

    def autocast(self, device_type, dtype=None, enabled=True, cache_enabled=None):  # noqa: ARG002
        self.products += 1
        work = (1e-3 if enabled else 3e-3) * (3 if self.products in self.busy else 1)
        self.cpu += work
        self.wall += work + self.wait
        return contextlib.nullcontext()


def sequential_speedup(clock: FakeClock) -> float:
    """The method bf16_speedup used before: four products of float32, then four under bf16, each side's best
    after the first."""

    def best(bf16: bool) -> float:
        times = []
        for _ in range(4):
            t = clock.perf_counter()
            clock.autocast("cpu", enabled=bf16)
            times.append(clock.perf_counter() - t)
        return min(times[1:])

    return best(False) / best(True)


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """Point runtime at a /proc/cpuinfo of the test's choosing."""

    def use(text: str) -> None:
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        monkeypatch.setattr(runtime, "_CPUINFO", path)

    return use


def test_a_burst_of_load_during_the_bf16_half_does_not_flip_the_choice(cpuinfo, monkeypatch):
    """A burst over the 6th to 8th products hits all of the old method's timed bf16 products (it read 1.0x:
    float32) but only three products of the interleaved pairs, so each side's best stays a quiet one."""
    cpuinfo(ZEN5)
    assert sequential_speedup(FakeClock(busy={6, 7, 8})) == pytest.approx(1.0)  # under BF16_PAYS: float32
    clock = FakeClock(busy={6, 7, 8})
    monkeypatch.setattr(runtime, "time", clock)
    monkeypatch.setattr(torch, "autocast", clock.autocast)
    choice = bf16_speedup(torch.device("cpu"), 8, 8, 8)
    assert choice.chosen and not choice.flag_decided
    assert choice.speedup == pytest.approx(3.0)
    assert (choice.pairs, choice.low, choice.high) == (runtime.PAIRS, pytest.approx(1.0), pytest.approx(3.0))
    assert clock.products == 2 + 2 * runtime.PAIRS  # a warm-up of each, then the pairs


def test_steady_work_on_every_core_does_not_flip_the_choice(cpuinfo, monkeypatch):
    """Neighbours on every core add the same preempted wall time to each product at either precision, which
    pulls a wall-clock ratio towards 1 (the old method read 13/11 = 1.18x: float32); the product's one
    thread counts only its own CPU time."""
    cpuinfo(ZEN5)
    assert sequential_speedup(FakeClock(busy=set(), wait=10e-3)) == pytest.approx(13 / 11)
    clock = FakeClock(busy=set(), wait=10e-3)
    monkeypatch.setattr(runtime, "time", clock)
    monkeypatch.setattr(torch, "autocast", clock.autocast)
    assert bf16_speedup(torch.device("cpu"), 8, 8, 8).speedup == pytest.approx(3.0)


def test_the_products_run_on_one_thread_and_the_threads_come_back(cpuinfo, monkeypatch):
    cpuinfo(ZEN5)
    clock, threads = FakeClock(busy=set()), []
    monkeypatch.setattr(runtime, "time", clock)
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: threads.append(torch.get_num_threads()) or
                        clock.autocast(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bf16_speedup(torch.device("cpu"), 8, 8, 8)
        assert set(threads) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_timing_stops_at_the_budget_on_a_slow_machine(cpuinfo, monkeypatch):
    """Past TIMING_BUDGET_S (wall time) no pair is started once MIN_PAIRS are done."""
    cpuinfo(ZEN5)
    clock = FakeClock(busy=set(), wait=10e-3)
    monkeypatch.setattr(runtime, "time", clock)
    monkeypatch.setattr(torch, "autocast", clock.autocast)
    monkeypatch.setattr(runtime, "TIMING_BUDGET_S", 0.05)  # pairs take 24 ms of wall time: the third crosses it
    choice = bf16_speedup(torch.device("cpu"), 8, 8, 8)
    assert choice.pairs == runtime.MIN_PAIRS and choice.chosen


def test_the_cpu_flags_say_which_bf16_instructions_it_has(cpuinfo):
    assert native_bf16(cpu_flags(ZEN5)) == "AVX512_BF16"
    assert native_bf16(cpu_flags(SAPPHIRE_RAPIDS)) == "AMX"
    assert cpu_flags(ZEN3) == {"fpu", "sse2", "avx", "avx2", "fma"} and native_bf16(cpu_flags(ZEN3)) is None
    assert cpu_flags(GRAVITON3) is None  # no x86 flags: unknown, not "without bf16"
    cpuinfo(SAPPHIRE_RAPIDS)
    assert native_bf16(cpu_flags()) == "AMX"  # read from the file


def test_cpuinfo_missing_means_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "_CPUINFO", tmp_path / "absent")
    assert cpu_flags() is None


def test_a_cpu_without_bf16_instructions_takes_float32_untimed(cpuinfo, monkeypatch):
    """Emulated bf16 never pays; a noisy timing must not say it does, so nothing is timed."""
    cpuinfo(ZEN3)
    clock = FakeClock(busy=set())
    monkeypatch.setattr(torch, "autocast", clock.autocast)
    choice = bf16_speedup(torch.device("cpu"), 256, 64, 128)
    assert not choice.chosen and choice.emulated and choice.pairs == 0 and clock.products == 0
    assert choice.describe() == ("bf16=auto: neither AMX nor AVX512_BF16 in this CPU's flags, so torch would "
                                 "emulate bf16 (not timed) -> float32")


@pytest.mark.parametrize("native,f32,chosen,flag_decided", [
    ("AVX512_BF16", [2.4, 2.6, 2.2], True, False),  # clears the bar: bf16 with or without the flag
    (None, [2.4, 2.6, 2.2], True, False),
    ("AVX512_BF16", [1.1, 1.4, 1.2], True, True),  # near the bar, a pair cleared it: the flag decides
    (None, [1.1, 1.4, 1.2], False, False),  # the same timings with no flags to read: the bar alone
    ("AMX", [1.1, 1.2, 1.15], False, False),  # no pair cleared the bar
    ("AMX", [0.8, 1.4, 0.9], False, False),  # bf16 slower at its best: the flag does not outweigh that
])
def test_the_rule(native, f32, chosen, flag_decided):
    choice = Bf16Choice.measured(native, f32, [1.0, 1.0, 1.0])
    assert (choice.chosen, choice.flag_decided) == (chosen, flag_decided)
    assert (choice.speedup, choice.low, choice.high, choice.pairs) == (min(f32), min(f32), max(f32), 3)


def test_the_line_says_what_was_measured_and_how_sure():
    assert Bf16Choice.measured("AVX512_BF16", [2.4, 2.6, 2.2], [1.0, 1.0, 1.0]).describe() == (
        "bf16=auto: AVX512_BF16 present; bf16 products 2.20x float32's (best of 3 interleaved pairs, pairs "
        "ranged 2.20x-2.60x) -> bf16 autocast")
    assert Bf16Choice.measured("AMX", [1.1, 1.4, 1.2], [1.0, 1.0, 1.0]).describe() == (
        "bf16=auto: AMX present; bf16 products 1.10x float32's (best of 3 interleaved pairs, pairs ranged "
        "1.10x-1.40x), under 1.25x but within the pairs' range, so AMX decides -> bf16 autocast")
    assert Bf16Choice.measured(None, [1.1, 1.4, 1.2], [1.0, 1.0, 1.0]).describe() == (
        "bf16=auto: no x86 flags to read bf16 support from; bf16 products 1.10x float32's (best of 3 "
        "interleaved pairs, pairs ranged 1.10x-1.40x) -> float32")
    assert Bf16Choice(True, "cuda").describe() == "bf16=auto: this CUDA GPU supports bf16 (not timed) -> bf16 autocast"
    assert Bf16Choice(False, "mps").describe() == "bf16=auto: bf16 is not measured on mps -> float32"


def test_every_rank_takes_the_same_choice():
    """bf16 only where every rank chose it; the numbers are the slowest rank's, and the line says so."""
    ranks = [Bf16Choice.measured("AMX", [3.0, 3.2], [1.0, 1.0]), Bf16Choice.measured("AMX", [1.0, 1.1], [1.0, 1.0])]
    sent = []
    for choice in ranks:  # what each rank puts into the all-reduce
        choice.across(lambda values: sent.append(values) or values, 2)
    agreed = [choice.across(lambda values: [max(column) for column in zip(*sent, strict=True)], 2) for choice in ranks]
    assert agreed[0] == agreed[1]
    assert not agreed[0].chosen and (agreed[0].speedup, agreed[0].pairs) == (pytest.approx(1.0), 2)
    assert "bf16 products 1.00x float32's on the slowest of 2 ranks (best of 2" in agreed[0].describe()
    assert Bf16Choice.measured("AMX", [3.0], [1.0]).across(lambda values: values, 1).describe() == (
        "bf16=auto: AMX present; bf16 products 3.00x float32's (best of 1 interleaved pairs, pairs ranged "
        "3.00x-3.00x) -> bf16 autocast")
