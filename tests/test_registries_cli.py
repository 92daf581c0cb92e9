"""An optimizer with a setting of its own and an expert product, each one file of one's own, reach
`nanollama4 train` through `--import` (the thought experiments end to end: the registration is all the code
there is).

They run through `main(argv)` in this process; the `imported` fixture then takes their registrations and
modules away again, which is also how a later command is shown a fresh interpreter's registries."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanollama4.base.configfile import tomllib
from nanollama4.base.parts import OPTIMIZERS
from nanollama4.ops.products import REGISTRY
from tests.helpers import TINY, run_cli

MY_SGD = textwrap.dedent('''
    """A user's optimizer with a setting of its own: SGD whose momentum is [train.plain-sgd] momentum."""
    from dataclasses import dataclass

    import torch

    from nanollama4.base.config import Decay
    from nanollama4.training.optim import OptimizerKind, trainable_parameters


    @dataclass
    class PlainSGDSettings:
        momentum: Decay = 0.9  # the momentum of every weight


    class PlainSGD(OptimizerKind, name="plain-sgd", about="SGD with momentum"):
        Settings = PlainSGDSettings

        @classmethod
        def build(cls, model, tc):
            return torch.optim.SGD(trainable_parameters(model), lr=tc.lr, momentum=cls.settings(tc).momentum)

        @classmethod
        def state_count(cls, counts):
            return counts.total

        @classmethod
        def describe(cls, tc, n_experts):
            return f"plain-sgd with momentum {cls.settings(tc).momentum} at {tc.lr:g}"
''')

MY_PRODUCT = textwrap.dedent('''
    from pathlib import Path

    from nanollama4.model.moe import per_expert_products
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


@pytest.fixture
def imported(tmp_path) -> Iterator[dict[str, Path]]:
    """The two files, and afterwards this process as a fresh one would be: neither registered nor imported."""
    files = {"sgd": tmp_path / "my_sgd.py", "product": tmp_path / "my_product.py"}
    files["sgd"].write_text(MY_SGD)
    files["product"].write_text(MY_PRODUCT)
    yield files
    forget()


def forget() -> None:
    OPTIMIZERS.remove("plain-sgd")
    REGISTRY.remove("my_loop")
    for name in ("my_sgd", "my_product"):
        sys.modules.pop(name, None)


def _train(capsys, run: Path, corpus, *extra: str) -> tuple[int, str, str]:
    return run_cli(["train", *TINY, "--data", str(corpus), "--out", str(run), "--max-steps", "3", *extra], capsys)


def test_an_imported_optimizer_with_a_setting_of_its_own_trains_saves_it_and_resumes(imported, tmp_path, corpus,
                                                                                     capsys):
    """--import a module that defines an optimizer and its setting, set it with --set, find it in config.toml
    and train_config.json; a resume without the file says which to pass, and with it reads the setting back."""
    run, sgd = tmp_path / "run", imported["sgd"]
    rc, out, err = _train(capsys, run, corpus, "--import", str(sgd), "--set", "optimizer=plain-sgd",
                          "--set", "plain-sgd.momentum=0.5")
    assert rc == 0, err
    toml = tomllib.loads((run / "config.toml").read_text())
    assert toml["train"]["optimizer"] == "plain-sgd" and toml["train"]["plain-sgd"] == {"momentum": 0.5}
    saved = json.loads((run / "last" / "train_config.json").read_text())
    assert saved["plain-sgd.momentum"] == 0.5 and saved["optimizer_imports"] == str(sgd)

    forget()  # a later command in a fresh interpreter: the kind is not registered
    resume = ["train", "--resume", str(run), "--max-steps", "4"]
    rc, out, err = run_cli(resume, capsys)
    assert rc == 2 and "Traceback" not in err and f"pass --import {sgd}" in err, err
    rc, out, err = run_cli([*resume, "--import", str(sgd)], capsys)
    assert rc == 0, err
    assert "plain-sgd with momentum 0.5" in out  # the resumed run's summary: its kind read the saved setting
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "lm_loss" in x] == [1, 2, 3, 4]
    rc, out, err = run_cli(["train", "--resume", str(run), "--import", str(sgd), "--max-steps", "5", "--set",
                            "plain-sgd.momentum=1.5"], capsys)
    assert rc == 2 and "plain-sgd.momentum (1.5) must be in [0, 1)" in err, err


def test_without_the_file_the_optimizer_is_refused_naming_the_kinds(imported, tmp_path, corpus, capsys):
    rc, out, err = _train(capsys, tmp_path / "run", corpus, "--set", "optimizer=plain-sgd")
    assert rc == 2 and "Traceback" not in err
    assert "'adamw'" in err and "--import" in err


def test_an_expert_product_in_a_file_of_ones_own_is_what_auto_picks_in_training(imported, tmp_path, corpus,
                                                                                capsys):
    rc, out, err = _train(capsys, tmp_path / "run", corpus, "--import", str(imported["product"]))
    assert rc == 0, err
    calls = (tmp_path / "my_product.calls").read_text()
    assert len(calls) >= 3 * 4, calls  # every MoE layer of the tiny model, every step, went through it
