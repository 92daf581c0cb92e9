"""Each experiment script, run on its smoke-test scale (--tiny: tiny models, 3 steps, a small corpus),
writes its results, table and plots: so that none of them can rot unnoticed. The full runs and their
reading are in docs/experiments.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanollama4.experiments import EXPERIMENTS
from nanollama4.experiments.common import loss_at, verdict
from nanollama4.experiments.router_tricks import starved
from tests.helpers import write_corpus

SCRIPTS = Path(__file__).parent.parent / "benchmarks" / "experiments"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("experiments") / "corpus.txt", n_lines=400)


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_each_experiment_script_runs_on_a_tiny_setting(name, corpus, tmp_path):
    out = tmp_path / name
    proc = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), "--tiny", "--quiet", "--data", str(corpus),
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "NANOLLAMA4_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["experiment"] == name and doc["arms"]
    for arm in doc["arms"]:
        assert arm["steps"] == 3 and arm["full_val_loss"] > 0 and arm["val_curve"]
    plots = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("plot: ")]
    assert plots
    for plot in plots:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert table.count("\n|") >= 3 and "spread" in table
    # a second run into the same folder is refused rather than overwriting it
    again = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), "--tiny", "--quiet", "--data", str(corpus),
                            "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds results" in again.stderr


def test_the_helpers_behind_the_readings():
    curve = [{"tokens": 0, "time": 0.0, "val_loss": 3.0}, {"tokens": 100, "time": 10.0, "val_loss": 2.0}]
    assert loss_at(curve, "time", 5.0) == pytest.approx(2.5)
    assert loss_at(curve, "tokens", 100) == pytest.approx(2.0)
    assert verdict(-0.01, 0.02) == "tie" and verdict(-0.03, 0.02) == "better" and verdict(0.03, 0.02) == "worse"
    # 2 layers x 4 experts; one expert of layer 1 gets 1% of the assignments (under 10% of the fair 25%)
    load = [[[0.25, 0.25, 0.25, 0.25], [0.33, 0.33, 0.33, 0.01]]] * 10
    assert starved(load, 0.25) == (1, 8)
