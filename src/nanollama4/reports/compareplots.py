"""The plots of `compare` (compare.py): validation and training loss, each MoE run's expert load, and the
routing telemetry, each run in one colour that is the same in every plot.

Apart from the table (compare.py): they read a few fields of its per-run records (`RunRecord` below) and the
plots module's drawing helpers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from ..model.memory import format_count
from .plots import (
    Routing,
    draw_load_heatmap,
    expert_load_of,
    load_norm,
    max_entropy_line,
    moving_average,
    routing_axes,
    routing_of,
    routing_panels,
    save_png,
)


class RunRecord(Protocol):
    """What the plots read of `compare.RunRecord`: its name, its step and validation lines, its tokens seen."""

    name: str
    train: list[dict]
    val: list[dict]

    @property
    def tokens(self) -> np.ndarray | None: ...


def finite_number(v: object) -> bool:
    """A finite JSON number (not a bool)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def run_colours(n: int) -> list:
    """One qualitative colour per run: tab10 up to ten runs, tab20 up to twenty, then evenly spaced hues."""
    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [matplotlib.colormaps["tab20"](i) for i in range(n)]
    return [matplotlib.colormaps["hsv"](i / n) for i in range(n)]


def _legend(fig: Figure, handles: list[Line2D]) -> None:
    """One legend below the panels for the whole figure: one row of up to six entries, else rows of four."""
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles) if len(handles) <= 6 else 4,
               fontsize=9, frameon=False)


def _run_handles(runs: Sequence[RunRecord], colours: list) -> list[Line2D]:
    return [Line2D([], [], color=c, lw=2.5, label=r.name) for r, c in zip(runs, colours, strict=True)]


def _time_unit(seconds: float) -> tuple[float, str]:
    return (3600.0, "hours") if seconds >= 3 * 3600 else (60.0, "minutes") if seconds >= 180 else (1.0, "seconds")


def _smooth(loss: np.ndarray) -> np.ndarray:
    """The run plot's smoothing, so that a curve here matches the run's own RUN/plots/loss.png."""
    window = min(max(len(loss) // 25, 1), 200)
    return moving_average(loss, window) if window > 1 else loss


def seconds(line: dict) -> float:
    return float(line["time"]) if finite_number(line.get("time")) else math.nan


def _x_axes(run: RunRecord, time_scale: float) -> tuple[list, list]:
    """The x of the run's train lines and of its val lines on each panel: step, tokens seen, time; None where
    the run has no token count."""
    tokens = run.tokens
    steps = np.array([r["step"] for r in run.train], dtype=float)
    val_steps = np.array([r["step"] for r in run.val], dtype=float)
    val_tokens = None
    if tokens is not None:  # a val line comes after its step's train line: the tokens seen by then
        val_tokens = np.interp(val_steps, steps, tokens) if len(steps) else np.full(len(val_steps), math.nan)
    train_x = [steps, tokens, np.array([seconds(r) for r in run.train]) / time_scale]
    val_x = [val_steps, val_tokens, np.array([seconds(r) for r in run.val]) / time_scale]
    return train_x, val_x


def plot_losses(runs: Sequence[RunRecord], colours: list, out: Path) -> Path:
    """Validation (markers) and smoothed training loss of every run against step, tokens and wall-clock time."""
    fig = Figure(figsize=(15, 5.2), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    scale, unit = _time_unit(max([seconds(r.train[-1]) for r in runs if r.train] + [0.0]))
    shown: list[float] = []  # the values the y range is fitted to
    for run, colour in zip(runs, colours, strict=True):
        train_x, val_x = _x_axes(run, scale)
        smooth = _smooth(np.array([r["loss"] for r in run.train], dtype=float))
        val = np.array([r["val_loss"] for r in run.val], dtype=float)
        shown += list(smooth[len(smooth) // 10:]) + list(val[len(val) // 10:])
        for ax, x, vx in zip(axes, train_x, val_x, strict=True):
            if x is not None and len(smooth):
                ax.plot(x, smooth, color=colour, lw=1.1, alpha=0.55)
            if vx is not None and len(val):
                ax.plot(vx, val, "o-", color=colour, lw=1.8, ms=4)
    no_tokens = [r.name for r in runs if r.train and r.tokens is None]
    titles = ("against optimizer step", "against training tokens seen", "against wall-clock time (with validation)")
    labels = ("step", "tokens", f"time ({unit})")
    for ax, title, label in zip(axes, titles, labels, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(label)
        ax.grid(True, alpha=0.3)
    axes[1].xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_count(v)))
    axes[0].set_ylabel("loss (nats/token)")
    if no_tokens:
        axes[1].text(0.02, 0.02, "no token count: " + ", ".join(no_tokens), transform=axes[1].transAxes,
                     fontsize=8, color="gray", va="bottom")
    finite = [v for v in shown if math.isfinite(v)]
    if finite:  # the first steps' loss is far above the rest: fit the range to where runs differ
        lo, hi = min(finite), max(finite)
        pad = 0.05 * (hi - lo) or 0.05
        axes[0].set_ylim(lo - pad, hi + pad)
    else:
        axes[0].text(0.5, 0.5, "no steps logged yet", transform=axes[0].transAxes, ha="center", color="gray")
    fig.suptitle(f"Loss of {_runs_word(len(runs))}: validation (dots) and training (thin line, running mean)",
                 fontsize=12)
    style = [Line2D([], [], color="gray", marker="o", lw=1.8, ms=4, label="validation"),
             Line2D([], [], color="gray", lw=1.1, alpha=0.55, label="training, smoothed")]
    _legend(fig, _run_handles(runs, colours) + style)
    return save_png(fig, out / "losses.png")


def _runs_word(n: int, what: str = "run") -> str:
    return f"1 {what}" if n == 1 else f"{n} {what}s"


def plot_expert_load(runs: Sequence[RunRecord], colours: list, out: Path) -> Path | None:
    """A grid of heatmaps, MoE layers down and runs across, of each expert's load over uniform during training;
    None when no run is MoE."""
    found = [(run, colour, load) for run, colour in zip(runs, colours, strict=True)
             if (load := expert_load_of(run.train)) is not None]
    if not found:
        return None
    n_layers = max(load[1].shape[1] for _, _, load in found)
    n_experts = max(load[1].shape[2] for _, _, load in found)
    norm = load_norm(max(float(np.nanmax(load[1])) for _, _, load in found))
    panel_h = min(max(0.12 * n_experts + 0.6, 1.0), 2.2)
    fig = Figure(figsize=(min(max(1.8 + 3.2 * len(found), 7.0), 24), min(1.8 + panel_h * n_layers, 40)),
                 layout="constrained")
    grid = fig.subplots(n_layers, len(found), squeeze=False)
    mesh = None
    for col, (run, colour, (steps, load)) in enumerate(found):
        for layer in range(n_layers):
            ax: Axes = grid[layer, col]
            if layer >= load.shape[1]:
                ax.set_visible(False)
                continue
            mesh = draw_load_heatmap(ax, steps, load[:, layer, :], norm)
            if col == 0:
                ax.set_ylabel(f"MoE layer {layer}\nexpert", fontsize=8)
            if layer == load.shape[1] - 1:
                ax.set_xlabel("step", fontsize=8)
            else:
                ax.tick_params(labelbottom=False)
        grid[0, col].set_title(run.name, color=colour, fontsize=10, fontweight="bold")
    fig.suptitle("Expert load / uniform over training\nwhite = balanced, red = overloaded, blue = starved", fontsize=11)
    fig.colorbar(mesh, ax=grid.ravel().tolist(), label="load / uniform", aspect=max(20.0, fig.get_figheight() / 0.2))
    return save_png(fig, out / "expert_load.png")


def plot_routing(runs: Sequence[RunRecord], colours: list, out: Path) -> Path | None:
    """The routing telemetry of every MoE run: per run the mean over its MoE layers (line) and the range over
    them (band); None when no run's validations carry it."""
    found: list[tuple[RunRecord, Any, Routing]] = [
        (run, colour, routing) for run, colour in zip(runs, colours, strict=True)
        if (routing := routing_of(run.val)) is not None]
    if not found:
        return None
    panels = [p for p in routing_panels() if any(r.has(*p[2]) for _, _, r in found)]
    if not panels:  # load shares alone: expert_load.png shows them
        return None
    fig = Figure(figsize=(14, 3.3 * -(-len(panels) // 3) + 1.4), layout="constrained")
    experts = sorted({r.n_experts for _, _, r in found if r.n_experts})
    for ax, (title, ylabel, keys, factor) in zip(routing_axes(fig, len(panels)), panels, strict=True):
        for _, colour, routing in found:
            if not routing.has(*keys):
                continue
            if len(keys) > 1:  # a range (the balancing bias's lowest and highest): its width
                per_layer = routing.values[keys[-1]] - routing.values[keys[0]]
            else:
                per_layer = routing.values[keys[0]] * factor
            with np.errstate(all="ignore"):
                mean = np.nanmean(per_layer, axis=1)
            ax.fill_between(routing.steps, np.nanmin(per_layer, axis=1), np.nanmax(per_layer, axis=1),
                            color=colour, alpha=0.1, lw=0)
            ax.plot(routing.steps, mean, ".-", color=colour, lw=1.5, ms=4)
        if keys == ("entropy",):
            for n in experts:
                max_entropy_line(ax, n)
        if keys == ("bias_min", "bias_max"):
            title, ylabel = "Balancing bias spread (max − min of router.expert_bias)", "max − min"
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
    fig.suptitle(f"Routing of {_runs_word(len(found), 'MoE run')} between validations: line = mean over the MoE "
                 "layers, band = their range", fontsize=11)
    _legend(fig, _run_handles([r for r, _, _ in found], [c for _, c, _ in found]))
    return save_png(fig, out / "routing.png")
