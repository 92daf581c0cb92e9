"""The thread count a run with threads=0 trains at: all cores while they pay, fewer while other work on the
machine slows the step, and back when it stops (timings given, not measured: the rule is under test)."""

from __future__ import annotations

import pytest
import torch

from nanollama4.threads import FIRST_PROBE, PROBE_EVERY, ThreadWatch, ladder


@pytest.fixture(autouse=True)
def kept_threads():
    threads = torch.get_num_threads()
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
