"""An optimizer and an expert product of one's own, each one file, reach `nanollama4 train` through `--import`
(issue 48's thought experiment, end to end: the registration is all the code there is).

Each runs in a subprocess, so that the registrations do not outlive the test in this process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.helpers import TINY

MY_SGD = textwrap.dedent('''
    import torch

    from nanollama4.optim import OptimizerKind, trainable_parameters


    class PlainSGD(OptimizerKind, name="plain-sgd", about="SGD with momentum 0.9"):
        @classmethod
        def build(cls, model, tc):
            return torch.optim.SGD(trainable_parameters(model), lr=tc.lr, momentum=0.9)

        @classmethod
        def state_count(cls, counts):
            return counts.total
''')

MY_PRODUCT = textwrap.dedent('''
    from pathlib import Path

    from nanollama4.moe import per_expert_products
    from nanollama4.ops.products import REGISTRY, register_product

    CALLS = Path(__file__).with_suffix(".calls")


    def my_product(x_AD, gate_up_EDH, down_EHD, counts_E, expert_A):
        with CALLS.open("a") as f:
            f.write("1")
        return per_expert_products(x_AD, gate_up_EDH, down_EHD, counts_E)


    # measured faster than every built-in product wherever both apply, and it applies everywhere
    register_product("my_loop", my_product, supports=lambda x, hidden, n_experts, rows: True,
                     beats=tuple(REGISTRY))
''')


def _train(tmp_path, corpus, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanollama4.cli", "train", *TINY, "--data", str(corpus), "--out",
                           str(tmp_path / "run"), "--max-steps", "3", *extra], capture_output=True, text=True,
                          timeout=300)


def test_an_optimizer_in_a_file_of_ones_own_trains_from_the_command_line(tmp_path, corpus):
    (tmp_path / "my_sgd.py").write_text(MY_SGD)
    proc = _train(tmp_path, corpus, "--import", str(tmp_path / "my_sgd.py"), "--set", "optimizer=plain-sgd")
    assert proc.returncode == 0, proc.stderr
    assert "plain-sgd at" in proc.stdout  # the summary line asks the kind
    saved = json.loads((tmp_path / "run" / "last" / "train_config.json").read_text())
    assert saved["optimizer"] == "plain-sgd"
    # without the file the name is refused in one line that lists the kinds there are and says what to pass
    proc = _train(tmp_path / "other", corpus, "--set", "optimizer=plain-sgd")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'adamw'" in proc.stderr and "--import" in proc.stderr


def test_an_expert_product_in_a_file_of_ones_own_is_what_auto_picks_in_training(tmp_path, corpus):
    (tmp_path / "my_product.py").write_text(MY_PRODUCT)
    proc = _train(tmp_path, corpus, "--import", str(tmp_path / "my_product.py"))
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "my_product.calls").read_text()
    assert len(calls) >= 3 * 4, calls  # every MoE layer of the tiny model, every step, went through it


def test_a_run_trained_with_ones_own_optimizer_names_the_file_a_resume_needs(tmp_path, corpus):
    """As a run records the module of its router, it records its optimizer's: a resume without it says what
    to pass, and with it continues."""
    (tmp_path / "my_sgd.py").write_text(MY_SGD)
    assert _train(tmp_path, corpus, "--import", str(tmp_path / "my_sgd.py"), "--set",
                  "optimizer=plain-sgd").returncode == 0
    saved = json.loads((tmp_path / "run" / "last" / "train_config.json").read_text())
    assert saved["optimizer_imports"] == str(tmp_path / "my_sgd.py")
    resume = [sys.executable, "-m", "nanollama4.cli", "train", "--resume", str(tmp_path / "run"), "--max-steps", "4",
              "--quiet"]
    proc = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"pass --import {tmp_path / 'my_sgd.py'}" in proc.stderr, proc.stderr
    proc = subprocess.run([*resume, "--import", str(tmp_path / "my_sgd.py")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
