"""Sweeps, as an engineer runs one: a sweep file of their own (a grid or named arms, seeds, a budget), trained
arm by arm into normal run folders, read with paired statistics, continued after an interruption without
retraining what finished; and every mistake in the file refused in one line before anything trains."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nanollama4.errors import ConfigError
from nanollama4.experiments import EXPERIMENTS, common, sweep_file
from nanollama4.experiments.sweep import read_sweep
from tests.helpers import assert_cli_error, run_cli, stop_the_third_training

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SWEEP = textwrap.dedent('''
    data = "corpus.txt"

    [model]
    preset = "tiny"

    [train]
    batch_size = 4
    seq_len = 32
    eval_interval = 2
    eval_batches = 2
    warmup_steps = 2

    [sweep]
    title = "two against four experts"
    seeds = [0, 1]
    max_steps = 4
    grid = { n_experts = [2, 4] }
    pairs = [["n_experts=4", "n_experts=2"]]
''')


@pytest.fixture
def sweep_dir(tmp_path, corpus) -> Path:
    (tmp_path / "corpus.txt").write_bytes(corpus.read_bytes())
    (tmp_path / "exp.toml").write_text(SWEEP)
    return tmp_path


def test_a_two_arm_two_seed_sweep_prints_its_paired_line_and_resumes(sweep_dir, capsys, monkeypatch):
    """Interrupted in its third run, the sweep rerun into the same folder reads the finished arms back
    untouched, resumes the interrupted one and trains the last; then prints the pair's reading."""
    out = sweep_dir / "out"
    real_train, calls = common.train, []

    monkeypatch.setattr(common, "train", stop_the_third_training(real_train, calls))  # after 2 of its steps
    rc, _, err = run_cli(["sweep", str(sweep_dir / "exp.toml"), "--out", str(out), "--quiet"], capsys)
    assert rc == 3 and f"--out {out}" in err
    # seed by seed: both arms of seed 0, then seed 1's first
    assert [p.name for p in calls] == ["n_experts=2-seed0", "n_experts=4-seed0", "n_experts=2-seed1"]
    kept = {p: (p / "metrics.jsonl").read_bytes() for p in calls[:2]}
    monkeypatch.setattr(common, "train", real_train)
    rc, printed, err = run_cli(["sweep", str(sweep_dir / "exp.toml"), "--out", str(out), "--quiet"], capsys)
    assert rc == 0, err
    assert all((p / "metrics.jsonl").read_bytes() == kept[p] for p in kept)  # finished arms: read back
    rows = [json.loads(x) for x in (calls[2] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "lm_loss" in r] == [1, 2, 3, 4]  # the interrupted one resumed
    line = re.search(r"n_experts=4 minus n_experts=2, per seed ([-+]\d\.\d{4}), ([-+]\d\.\d{4}): "
                     r"([-+]\d\.\d{4}) -> (undecided \(2 seeds\))", printed)
    assert line, printed
    doc = json.loads((out / "results.json").read_text())
    losses = {(a["name"], a["seed"]): a["full_val_loss"] for a in doc["arms"]}
    diffs = [losses["n_experts=4", s] - losses["n_experts=2", s] for s in (0, 1)]
    assert [float(line[1]), float(line[2])] == pytest.approx(diffs, abs=1e-4)  # the paired line is the losses'
    assert float(line[3]) == pytest.approx(sum(diffs) / 2, abs=1e-4)
    for (name, seed), loss in losses.items():  # each arm's score is its run's own, recorded there for compare
        record = json.loads((out / "runs" / f"{name}-seed{seed}" / "evaluation.json").read_text())
        assert record["full_val_loss"] == pytest.approx(loss) and record["checkpoint"] == "step-0000004"
    table = (out / "table.md").read_text()
    assert "| n_experts=2 |" in table and "| n_experts=4 |" in table and "two against four experts" in table
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    rc, _, err = run_cli(["sweep", str(sweep_dir / "exp.toml"), "--out", str(out), "--quiet"], capsys)
    assert "already holds results" in assert_cli_error(rc, err, "sweep")


def test_a_sweep_under_a_time_budget_and_named_arms(sweep_dir, capsys):
    """[[arm]] tables with fields of both [model] and [train], a max_time budget: each arm trains for the
    time given (validation by the clock), and each pair is read against the first arm by default."""
    text = SWEEP.replace("max_steps = 4", 'max_time = "2s"').replace(
        'grid = { n_experts = [2, 4] }\n', "").replace('pairs = [["n_experts=4", "n_experts=2"]]\n', "")
    text += textwrap.dedent('''
        [[arm]]
        name = "dense"
        n_experts = 0

        [[arm]]
        name = "moe, lr 3e-3"
        lr = 3e-3
    ''')
    (sweep_dir / "timed.toml").write_text(text)
    out = sweep_dir / "timed"
    rc, printed, err = run_cli(["sweep", str(sweep_dir / "timed.toml"), "--out", str(out), "--quiet",
                                "--seeds", "3"], capsys)
    assert rc == 0, err
    assert "moe, lr 3e-3 minus dense, per seed" in printed
    doc = json.loads((out / "results.json").read_text())
    for arm in doc["arms"]:
        state = json.loads((Path(arm["run_dir"]) / "last" / "train_state.json").read_text())
        assert state["elapsed"] >= 2.0 and arm["seed"] == 3
    config = (out / "runs" / "moe__lr_3e-3-seed3" / "config.toml").read_text()
    assert "lr = 0.003" in config and "n_experts = 4" in config


@pytest.mark.parametrize("change,expected", [
    (("[sweep]", "[sweep]\nrepeats = 2"), r"\[sweep\] has no key 'repeats'"),
    (("max_steps = 4", ""), r"one budget per arm: max_steps = N or max_time"),
    (("max_steps = 4", 'max_steps = 4\nmax_time = "1m"'), r"one budget per arm"),
    (("seeds = [0, 1]", "seeds = [0, 0]"), r"seeds = \[0, 0\] takes a list of distinct whole numbers"),
    (("n_experts = [2, 4]", "n_expert = [2, 4]"), r"arm 'n_expert=2' sets 'n_expert': no such field"),
    (("n_experts = [2, 4]", 'n_experts = ["two"]'), r"arm 'n_experts=two': n_experts = \"two\" takes a whole number"),
    (("n_experts = [2, 4]", "seed = [1, 2]"), r"sets 'seed': the seeds are \[sweep\] seeds"),
    (('preset = "tiny"', 'preset = "tiny"\nexperts_per_token = 3'), r"arm 'n_experts=2': experts_per_token \(3\)"),
    (('["n_experts=4", "n_experts=2"]', '["n_experts=8", "n_experts=2"]'), r"names the arm 'n_experts=8'"),
    (("[sweep]", "[sweeps]"), r"unknown key 'sweeps'; a sweep config file holds"),
])
def test_a_bad_sweep_file_is_one_line_before_anything_trains(sweep_dir, capsys, change, expected):
    (sweep_dir / "bad.toml").write_text(SWEEP.replace(*change))
    rc, _, err = run_cli(["sweep", str(sweep_dir / "bad.toml"), "--out", str(sweep_dir / "out")], capsys)
    line = assert_cli_error(rc, err, "sweep")
    assert re.search(expected, line), line
    assert "bad.toml" in line and not (sweep_dir / "out").exists()


def test_the_experiments_are_sweep_files():
    """Each experiment's arms, seeds and steps are in its packaged sweep file, readable as any sweep is."""
    for name in EXPERIMENTS:
        sweep = read_sweep(sweep_file(name))
        assert sweep.experiment == name and len(sweep.arms) >= 2 and sweep.seeds == (0, 1, 2)
        assert sweep.max_steps in (500, 800, 2500)
    moe = read_sweep(sweep_file("moe_vs_dense"))
    dense, n8 = (moe.configs(a)[0] for a in moe.arms if a.name in ("dense", "moe N=8 k=1"))
    assert (dense.n_experts, dense.ffn_dim, n8.n_experts, n8.expert_dim) == (0, 384, 8, 192)
    with pytest.raises(ConfigError, match="unknown experiment"):
        sweep_file("nope")


def test_a_tiny_experiment_takes_under_a_minute(tmp_path, corpus):
    """`--tiny` says "seconds": the slowest experiment (ten arms x three seeds), timed as a user runs it."""
    out = tmp_path / "tricks"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nanollama4", "experiment", "router_tricks", "--tiny", "--quiet",
                           "--data", str(corpus), "--out", str(out)], capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert seconds < 60, f"--tiny took {seconds:.0f} s"
