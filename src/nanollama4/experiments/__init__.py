"""Experiments that test the claims of the documents this project implements, rerunnable by anyone:
`nanollama4 experiment NAME` (or `python -m nanollama4.experiments NAME`). Each trains its arms with the
ordinary training loop, writes results.json, table.md and PNG plots into its folder, and prints where
they are. docs/experiments.md shows the plots and reads them.

This module stays light (the CLI reads EXPERIMENTS to build its parser); the experiments and
`common.Setting` are imported when one runs.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from .common import Setting

EXPERIMENTS = {
    "moe_vs_dense": "MoE vs dense at equal active parameters (N = 4..32, k = 1 and 2)",
    "shared_expert": "the shared expert on and off at equal active parameters",
    "irope_length": "all-RoPE vs iRoPE trained at 128, evaluated to 2,048, with and without temperature",
    "gqa": "1, 2, 4, 8 KV heads at 8 query heads: cache bytes, decode speed, loss",
    "router_tricks": "noise, -inf masking, capacity with and without overflow, aux loss, bias balancing",
}


def run_experiment(name: str, out: str | Path, setting: Setting | None = None, progress: bool = True) -> list[Path]:
    """Run experiment `name` into folder `out` (new or empty); returns the paths written: results.json,
    table.md, the plots. (Each module's `report(out)` redraws the table and plots from results.json.)"""
    from dataclasses import replace

    from .common import Setting

    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        what = "already holds results" if (out / "results.json").exists() else "is not empty"
        raise ConfigError(f"{out} {what}; pass a new or empty --out (experiments never overwrite)")
    module = import_module(f".{name}", __name__)
    setting = setting or Setting()
    if setting.steps is None:
        setting = replace(setting, steps=module.STEPS)
    return module.run(out, setting, progress)


__all__ = ["EXPERIMENTS", "run_experiment"]
