"""Experiments that test the claims of the documents this project implements, rerunnable by anyone:
`nanollama4 experiment NAME`. Each is a sweep file here (NAME.toml: the model, the arms, the seeds and
steps) run by the sweep machinery (`nanollama4.sweep`: every arm a normal run, seed by seed, resumable),
and a module (NAME.py) that measures what the arms' runs do not log and writes results.json, table.md and
PNG plots. docs/experiments.md shows the plots and reads them.

This module stays light (the CLI reads EXPERIMENTS to build its parser); the experiments and
`common.Setting` are imported when one runs.
"""

from __future__ import annotations

import json
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

    from ..sweep import read_sweep, run_sweep

    sweep = read_sweep(sweep_file(name))
    tiny = steps = seeds = None
    if setting is not None:
        if setting.data is not None:
            sweep = replace(sweep, base=replace(sweep.base, data=str(Path(setting.data).expanduser().resolve())))
        tiny, steps, seeds = setting.tiny, setting.steps, setting.seeds
    return run_sweep(sweep, out, progress, tiny=bool(tiny), seeds=seeds, max_steps=steps)


def start_folder(out: Path, started: dict) -> None:
    """Make `out` the folder of a sweep or experiment: new or empty (then `started` is written there), or the
    folder of an unfinished run of the same one (`started` equal to what it holds); refused otherwise."""
    from ..files import atomic_write

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a new or empty folder")
    started = json.loads(json.dumps(started))
    if out.is_dir() and any(out.iterdir()):
        if (out / "results.json").exists():
            raise ConfigError(f"{out} already holds results; pass a new or empty --out (experiments and sweeps "
                              "never overwrite)")
        if not (out / STARTED).exists() or _started(out) != started:
            raise ConfigError(f"{out} is not empty and not an unfinished run of this experiment or sweep with these "
                              "options; pass a new or empty --out (or the same options as the interrupted run)")
    else:  # what a rerun into this folder must match to continue it
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / STARTED, lambda tmp: Path(tmp).write_text(json.dumps(started, indent=1) + "\n"))


STARTED = "sweep.json"  # written when a sweep starts: the sweep and its options


def _started(out: Path) -> dict | None:
    from ..errors import Nanollama4Error
    from ..files import read_json

    try:
        return read_json(out / STARTED)
    except Nanollama4Error:
        return None


__all__ = ["EXPERIMENTS", "run_experiment", "sweep_file"]
