"""Plots of a training run's ``metrics.jsonl``: loss curves and MoE expert-load heatmaps.

Uses ``Figure`` + ``FigureCanvasAgg`` directly rather than pyplot, so importing this module never touches the
global backend of a caller (a notebook, a training loop) and works on headless machines.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from .errors import MissingRunFile
from .files import atomic_write, own_folder, write_failed

MAX_COLUMNS = 200  # heatmap columns; more than this is wider than the image in pixels anyway


def _parse_metrics(path: str | os.PathLike) -> tuple[list[dict], list[dict], int]:
    """Split metrics lines into (train, val, n_skipped). A run killed mid-write leaves a truncated last line,
    and a line may have been edited by hand: a line is kept only if its fields have the types the plots
    read (`_record`), and an expert-load table only within MAX_LAYERS x MAX_EXPERTS."""
    train: list[dict] = []
    val: list[dict] = []
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                rec = _record(json.loads(line))
            except (json.JSONDecodeError, RecursionError):
                rec = None
            if rec is None:
                bad += 1
            elif "loss" in rec:
                train.append(rec)
            elif "val_loss" in rec:
                val.append(rec)
    return train, val, bad


MAX_LAYERS, MAX_EXPERTS = 256, 1024  # an expert-load table larger than this is not one of ours


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _record(rec: object) -> dict | None:
    """The line as the plots read it, or None when it is not a step's record of ours."""
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec["step"], bool):
        return None
    if "loss" in rec and not _number(rec["loss"]) or "val_loss" in rec and not _number(rec["val_loss"]):
        return None
    load = rec.get("expert_load")
    if load is not None:
        ok = isinstance(load, list) and 0 < len(load) <= MAX_LAYERS and all(
            isinstance(row, list) and 0 < len(row) <= MAX_EXPERTS and len(row) == len(load[0])
            and all(_number(v) for v in row) for row in load)
        if not ok:
            return None
    return rec


def read_metrics(path: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """Return (train lines, val lines); unparsable lines are skipped so a live or crashed run can still be plotted."""
    train, val, _ = _parse_metrics(path)
    return train, val


def _metrics_path(run_dir: str | os.PathLike) -> Path:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MissingRunFile(f"no metrics.jsonl in {run_dir}; is this a training run directory?")
    return path


def save_png(fig: Figure, out: Path, dpi: int = 120) -> Path:
    """Write the PNG atomically (files.atomic_write), so a viewer polling the file never sees half of it."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_failed(out.parent, e) from None
    FigureCanvasAgg(fig)
    atomic_write(out, lambda p: fig.savefig(p, format="png", dpi=dpi))
    return out


def _moving_average(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean (shorter window at the start): no look-ahead, and the curve spans every step with no gap."""
    c = np.cumsum(np.insert(y, 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_losses(run_dir: str | os.PathLike) -> Path:
    """Train loss (raw + smoothed) and val loss vs step, the first thing to look at when judging a run."""
    train, val, bad = _parse_metrics(_metrics_path(run_dir))
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    train = sorted(train, key=lambda r: r["step"])
    if train:
        steps = np.array([r["step"] for r in train], dtype=float)
        loss = np.array([r["loss"] for r in train], dtype=float)
        ax.plot(steps, loss, lw=0.6, alpha=0.35, color="tab:blue", label="train")
        window = min(max(len(loss) // 25, 1), 200)
        if window > 1:
            smooth = _moving_average(loss, window)
            ax.plot(steps, smooth, lw=1.8, color="tab:blue", label=f"train (mean of last {window})")
    if val:
        val = sorted(val, key=lambda r: r["step"])
        ax.plot(
            [r["step"] for r in val], [r["val_loss"] for r in val], "o-", ms=4, lw=1.2, color="tab:orange", label="val"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"Loss — {Path(run_dir).resolve().name}")
    ax.grid(True, alpha=0.3)
    if train or val:
        ax.legend(loc="upper right")
    if bad:
        fig.text(0.01, 0.01, f"{bad} unparsable line(s) skipped", fontsize=7, color="gray")
    return save_png(fig, own_folder(Path(run_dir), "plots") / "loss.png")


def _bin_columns(steps: np.ndarray, load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average consecutive steps into at most MAX_COLUMNS bins; return (bin centres, binned load)."""
    groups = np.array_split(np.arange(len(steps)), min(len(steps), MAX_COLUMNS))
    centres = np.array([steps[g].mean() for g in groups])
    return centres, np.stack([load[g].mean(axis=0) for g in groups])


def _edges(centres: np.ndarray) -> np.ndarray:
    """Cell edges halfway between centres, so uneven logging intervals still map to the right x."""
    if len(centres) == 1:
        return np.array([centres[0] - 0.5, centres[0] + 0.5])
    mid = (centres[1:] + centres[:-1]) / 2
    return np.concatenate([[2 * centres[0] - mid[0]], mid, [2 * centres[-1] - mid[-1]]])


def plot_expert_load(run_dir: str | os.PathLike) -> Path | None:
    """Heatmap per MoE layer of expert load relative to uniform: shows collapse or imbalance over training."""
    train, _, _ = _parse_metrics(_metrics_path(run_dir))
    rows = [r for r in sorted(train, key=lambda r: r["step"]) if r.get("expert_load")]
    if not rows:
        return None
    shape = np.shape(rows[0]["expert_load"])
    rows = [r for r in rows if np.shape(r["expert_load"]) == shape]  # skip lines from a differently shaped model
    n_layers, n_experts = shape
    steps = np.array([r["step"] for r in rows], dtype=float)
    load = np.array([r["expert_load"] for r in rows], dtype=float) * n_experts  # (steps, layers, experts)
    centres, load = _bin_columns(steps, load)
    x = _edges(centres)
    y = np.arange(n_experts + 1) - 0.5
    norm = TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(2.0, float(np.nanmax(load))))
    panel_h = min(max(0.12 * n_experts + 0.6, 1.0), 2.2)
    fig = Figure(figsize=(9, min(1.4 + panel_h * n_layers, 40)), layout="constrained")
    axes = fig.subplots(n_layers, 1, sharex=True, squeeze=False)[:, 0]
    mesh = None
    for i, ax in enumerate(axes):
        mesh = ax.pcolormesh(x, y, load[:, i, :].T, cmap="RdBu_r", norm=norm, rasterized=True)
        ax.set_ylabel(f"layer {i}\nexpert", fontsize=8)
        if n_experts <= 8:
            ax.set_yticks(range(n_experts))
        ax.tick_params(labelsize=8)
    axes[-1].set_xlabel("step")
    axes[0].set_title(f"Expert load / uniform — {Path(run_dir).resolve().name} (1.0 = balanced)")
    # default aspect makes the bar height/20 wide, a slab on tall figures; keep it ~0.2 inch
    fig.colorbar(mesh, ax=list(axes), label="load / uniform", aspect=max(20.0, fig.get_figheight() / 0.2))
    return save_png(fig, own_folder(Path(run_dir), "plots") / "expert_load.png")


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write every plot that applies to this run into RUN/plots/ (never through a symlink planted there:
    `files.own_folder`); dense runs get only the loss plot. Lines of metrics.jsonl that are not records of
    ours are skipped, with one warning on stderr."""
    _, _, bad = _parse_metrics(_metrics_path(run_dir))
    own_folder(Path(run_dir), "plots")  # refused before any figure is drawn
    if bad:
        print(f"warning: {bad} line(s) of {Path(run_dir) / 'metrics.jsonl'} are not step records (cut short or "
              "edited) and were skipped", file=sys.stderr)
    paths = [plot_losses(run_dir)]
    expert = plot_expert_load(run_dir)
    if expert is not None:
        paths.append(expert)
    return paths
