"""The thread count a run with threads=0 trains at: all cores while they pay, fewer while other work on the
machine slows the step or holds its cores, and back when it stops (timings and other work's CPU time given,
not measured: the rule is under test; `Machine`, which measures the latter, is tested beside a busy loop)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import nanollama4.base.threads as threads_module
from nanollama4.base.threads import FIRST_PROBE, PROBE_EVERY, Machine, ThreadWatch, ladder


class Held:
    """Other work holding `cores` of `cpus` CPUs, as `Machine` would read it (a number at every reading)."""

    def __init__(self, cores: float = 0.0, cpus: int = 2) -> None:
        self.cores, self.cpus = cores, cpus

    def busy(self, at_least: float, wait: bool = False) -> float | None:  # noqa: ARG002
        return self.cores


@pytest.fixture(autouse=True)
def kept_threads(monkeypatch):
    """The process's thread count restored after each test, and a quiet machine unless a test says otherwise
    (this one may be busy with other tests)."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(threads_module, "Machine", Held)
    yield
    torch.set_num_threads(threads)


def drive(watch: ThreadWatch, seconds_at: dict[int, float], steps: int) -> list[tuple[int, str]]:
    """`steps` steps, each taking seconds_at[the thread count it ran at]; the lines the watch said."""
    said = []
    for step in range(steps):
        watch.before(step)
        line = watch.after(seconds_at[torch.get_num_threads()])
        if line:
            said.append((step, line))
    return said


def test_the_ladder_halves_down_to_one():
    assert ladder(2) == [2, 1] and ladder(16) == [16, 8, 4, 2, 1] and ladder(1) == [1] and ladder(6) == [6, 3, 1]


def test_a_busy_core_moves_the_run_to_fewer_threads_and_a_free_one_back():
    watch = ThreadWatch(2)
    loaded = {2: 1.0, 1: 0.2}  # two threads wait on the core another process holds
    said = drive(watch, loaded, 40)
    assert watch.current == 1 and torch.get_num_threads() == 1
    assert said == [(FIRST_PROBE, "threads: 2 -> 1 (a step took 0.2 s at 1 against 1 s at 2: other work shares "
                                  "the cores)")]
    quiet = {2: 0.5, 1: 0.9}
    said = drive(watch, quiet, 200)
    assert watch.current == 2 and said and "threads: 1 -> 2" in said[0][1] and "free again" in said[0][1]


def test_on_a_quiet_machine_the_probes_thin_out_and_nothing_moves():
    watch = ThreadWatch(2)
    probes = []
    for step in range(1000):
        watch.before(step)
        probing = watch.probing is not None
        if probing:
            probes.append(step)
        assert watch.after(0.9 if probing else 0.5) is None
    assert watch.current == 2 and torch.get_num_threads() == 2
    assert probes[:3] == [FIRST_PROBE, FIRST_PROBE + 2 * PROBE_EVERY, FIRST_PROBE + 6 * PROBE_EVERY]
    assert len(probes) <= 6  # one step in a hundred or fewer at the slower count


def test_one_core_has_nothing_to_watch():
    watch = ThreadWatch(1)
    assert drive(watch, {1: 0.5}, 50) == [] and watch.describe() == "threads: 1"


def test_a_resumed_run_probes_as_a_new_one_does():
    watch = ThreadWatch(2)
    probes = []
    for step in range(10_000, 10_200):
        watch.before(step)
        probes.append(watch.probing is not None)
        watch.after(0.9 if probes[-1] else 0.5)
    assert sum(probes) == 3 and probes.index(True) == FIRST_PROBE


def test_a_run_names_its_threads_and_leaves_the_process_as_it_found_it(tmp_path, capsys):
    from tests.helpers import train_cli

    torch.set_num_threads(2)
    rc, out, err = train_cli(capsys, "--set", "threads=0", "--max-steps", "2", "--out", str(tmp_path / "run"))
    assert rc == 0, err
    assert "  threads: 2 (all cores), watched: a step slowed by other work on the machine moves to fewer" in out
    assert torch.get_num_threads() == 2
    rc, out, err = train_cli(capsys, "--max-steps", "2", "--out", str(tmp_path / "fixed"))
    assert rc == 0 and "  threads: 1 (set by threads)" in out
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(("held", "count"), [(0.0, 2), (0.3, 2), (0.6, 1), (1.0, 1), (2.0, 1)])
def test_other_work_at_the_start_sets_the_count_before_the_first_step(held, count):
    # under a load of 13 on 2 cores one step at 2 threads took 45 s: a count chosen by comparing steps came
    # minutes late, so the first step already runs at what the free cores hold
    watch = ThreadWatch(2, Held(held))
    assert watch.current == count and torch.get_num_threads() == count
    if count == 1:
        assert watch.describe().startswith(f"threads: 1 of 2 (other work holds {held:.1f} of the 2 cores), watched:")
    else:
        assert watch.describe().startswith("threads: 2 (all cores), watched:")


def test_other_work_that_comes_and_goes_moves_the_count_at_the_end_of_the_step_that_saw_it():
    machine = Held(0.0, cpus=16)
    watch = ThreadWatch(16, machine)
    assert drive(watch, {16: 0.5, 8: 0.9, 4: 0.9, 2: 0.9, 1: 0.9}, 3) == []
    machine.cores = 1.0  # one busy process: 15 free cores hold 8 threads, not 16
    watch.before(3)
    assert watch.after(0.5) == "threads: 16 -> 8 (other work holds 1.0 of the 16 cores)"
    assert torch.get_num_threads() == 8
    machine.cores = 12.0
    watch.before(4)
    assert watch.after(0.5) == "threads: 8 -> 4 (other work holds 12.0 of the 16 cores)"
    machine.cores = 0.1
    watch.before(5)
    assert watch.after(0.5) == "threads: 4 -> 16 (the cores are free again: other work holds 0.1 of 16)"
    assert watch.current == 16 and torch.get_num_threads() == 16


def test_the_probes_stay_under_what_the_free_cores_hold():
    machine = Held(1.0)
    watch = ThreadWatch(2, machine)
    said = drive(watch, {2: 0.1, 1: 0.5}, 200)  # 2 threads would time faster: never tried while a core is held
    assert said == [] and watch.current == 1
    machine.cores = 0.0
    said = drive(watch, {2: 0.1, 1: 0.5}, 5)
    assert said == [(0, "threads: 1 -> 2 (the cores are free again: other work holds 0.0 of 2)")]


def test_the_machine_reads_a_busy_neighbour_as_other_work():
    if not hasattr(threads_module.os, "sched_getaffinity"):
        pytest.skip("reads Linux's /proc/stat")
    neighbour = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    try:
        time.sleep(0.3)  # started and spinning
        machine = Machine()
        held = machine.busy(0.3, wait=True)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert held is not None and held >= 0.7, held  # a whole core, less the kernel's 10 ms ticks' error
    assert machine.busy(10.0) is None  # under the window: nothing read yet
