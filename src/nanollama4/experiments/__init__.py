"""Experiments that test the claims of the documents this project implements, rerunnable by anyone:
`nanollama4 experiment NAME`. Each is a sweep file here (NAME.toml: the model, the arms, the seeds and
steps) run by the sweep machinery (`experiments.sweep`: every arm a normal run, seed by seed, resumable),
and a module (NAME.py) that measures what the arms' runs do not log and writes results.json, table.md and
PNG plots. docs/experiments.md shows the plots and reads them.

This module stays light (the CLI reads EXPERIMENTS to build its parser); the experiments and
`common.Setting` are imported when one runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..base.errors import ConfigError

if TYPE_CHECKING:
    from .common import Setting

EXPERIMENTS = {
    "moe_vs_dense": "MoE vs dense at equal active parameters (N = 4..32, k = 1 and 2)",
    "shared_expert": "the shared expert on and off at equal active parameters",
    "irope_length": "all RoPE, chunked RoPE and iRoPE trained at 128 with chunks of 32: loss and passkey to 2,048",
    "gqa": "1, 2, 4, 8 KV heads at 8 query heads: cache bytes, decode speed, loss",
    "router_tricks": "noise, -inf masking, capacity with and without overflow, aux loss, bias balancing",
    "expert_specialisation": "the demo MoE's experts read over its validation text against two nulls, shared "
                             "expert on and off; BPE on Shakespeare and on Python source",
    "moe_capacity": "a dense model short of capacity against MoEs of N = 4, 16, 64 at its active size, long runs",
}


def sweep_file(name: str) -> Path:
    """The packaged sweep file of experiment `name` (experiments/NAME.toml): its model, arms, seeds, steps."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}")
    return Path(__file__).with_name(f"{name}.toml")


def run_experiment(name: str, out: str | Path, setting: Setting | None = None, progress: bool = True) -> list[Path]:
    """Run experiment `name` into folder `out` (new or empty): its sweep file (`sweep_file`) through the sweep
    machinery, with `setting`'s data, seeds, steps and scale where given; returns the paths written:
    results.json, table.md, the plots. (Each module's `report(out)` redraws the table and plots from
    results.json.)

    Rerun with the same setting into the folder of an interrupted experiment, it continues: finished arms
    are read back, an interrupted arm resumes exactly from its last checkpoint, the rest are trained."""
    from dataclasses import replace

    from .sweep import read_sweep, run_sweep

    sweep = read_sweep(sweep_file(name))
    tiny = steps = seeds = None
    if setting is not None:
        if setting.data is not None:
            sweep = replace(sweep, base=replace(sweep.base, data=str(Path(setting.data).expanduser().resolve())))
        tiny, steps, seeds = setting.tiny, setting.steps, setting.seeds or None  # (): the file's seeds
    return run_sweep(sweep, out, progress, tiny=bool(tiny), seeds=seeds, max_steps=steps)


__all__ = ["EXPERIMENTS", "run_experiment", "sweep_file"]
