"""Plots of a training run's ``metrics.jsonl``: loss curves, MoE expert-load heatmaps and routing telemetry.

Uses ``Figure`` + ``FigureCanvasAgg`` directly rather than pyplot, so importing this module never touches the
global backend of a caller (a notebook, a training loop) and works on headless machines.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.collections import QuadMesh
from matplotlib.colors import Normalize, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ..base.errors import MissingRunFile
from ..base.files import atomic_write, json_lines, own_folder, write_failed
from ..model.moe import ROUTING_STATISTICS

MAX_COLUMNS = 200  # heatmap columns; more than this is wider than the image in pixels anyway


def parse_metrics(path: str | os.PathLike) -> tuple[list[dict], list[dict], int]:
    """Split metrics lines into (train, val, n_skipped). A run killed mid-write leaves a truncated last line,
    and a line may have been edited by hand or crafted: a line is kept only if it is JSON we could have
    written (`files.json_lines`: bounded in length, finite numbers) and its fields have the types the plots
    read (`_record`), and an expert-load table only within MAX_LAYERS x MAX_EXPERTS."""
    train: list[dict] = []
    val: list[dict] = []
    bad = 0
    for _, value in json_lines(Path(path)):
        rec = _record(value)
        if rec is None:
            bad += 1
        elif "loss" in rec:
            train.append(rec)
        elif "val_loss" in rec:
            val.append(rec)
    return train, val, bad


MAX_LAYERS, MAX_EXPERTS = 256, 1024  # an expert-load table larger than this is not one of ours


def _number(v: object) -> bool:
    """A JSON number (json_lines has refused non-finite ones and whole numbers too long to be a float)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def _load_table(load: object) -> bool:
    """A (layers x experts) table of numbers, within MAX_LAYERS x MAX_EXPERTS."""
    return isinstance(load, list) and 0 < len(load) <= MAX_LAYERS and all(
        isinstance(row, list) and 0 < len(row) <= MAX_EXPERTS and len(row) == len(load[0])
        and all(_number(v) for v in row) for row in load)


def routing_keys() -> tuple[str, ...]:
    """A val line's "routing" entries besides the load: one number per MoE layer for each declared statistic
    (`moe.ROUTING_STATISTICS`)."""
    return tuple(s.name for s in ROUTING_STATISTICS)


def _routing_ok(routing: object) -> bool:
    """Every known entry present is well formed and all agree on the number of layers; at least one is there.
    Entries are optional one by one, so that telemetry a model does not produce can simply be left out."""
    if not isinstance(routing, dict):
        return False
    lengths = set()
    if "load" in routing:
        if not _load_table(routing["load"]):
            return False
        lengths.add(len(routing["load"]))
    for key in routing_keys():
        if key in routing:
            values = routing[key]
            if not (isinstance(values, list) and 0 < len(values) <= MAX_LAYERS and all(_number(v) for v in values)):
                return False
            lengths.add(len(values))
    return len(lengths) == 1


def _record(rec: object) -> dict | None:
    """The line as the plots read it, or None when it is not a step's record of ours."""
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec["step"], bool):
        return None
    if "loss" in rec and not _number(rec["loss"]) or "val_loss" in rec and not _number(rec["val_loss"]):
        return None
    if "tokens_per_s" in rec and not (_number(rec["tokens_per_s"]) and rec["tokens_per_s"] > 0):
        return None  # a sweep's read-back divides by it (compare reads "time" and "tokens" only where they fit)
    if rec.get("expert_load") is not None and not _load_table(rec["expert_load"]):
        return None
    if "routing" in rec and not _routing_ok(rec["routing"]):
        return None
    return rec


def read_metrics(path: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """Return (train lines, val lines); unparsable lines are skipped so a live or crashed run can still be plotted
    (`parse_metrics` also counts them, for a warning)."""
    train, val, _ = parse_metrics(path)
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


def moving_average(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean (shorter window at the start): no look-ahead, and the curve spans every step with no gap."""
    c = np.cumsum(np.insert(y, 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_losses(run_dir: str | os.PathLike) -> Path:
    """Train loss (raw + smoothed) and val loss vs step, the first thing to look at when judging a run."""
    train, val, bad = parse_metrics(_metrics_path(run_dir))
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    train = sorted(train, key=lambda r: r["step"])
    if train:
        steps = np.array([r["step"] for r in train], dtype=float)
        loss = np.array([r["loss"] for r in train], dtype=float)
        ax.plot(steps, loss, lw=0.6, alpha=0.35, color="tab:blue", label="train")
        window = min(max(len(loss) // 25, 1), 200)
        if window > 1:
            smooth = moving_average(loss, window)
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


def expert_load_of(train: list[dict]) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, load / uniform as (steps, MoE layers, experts)) of a run's train lines, at most MAX_COLUMNS steps
    (consecutive steps averaged); None for a dense run."""
    rows = [r for r in sorted(train, key=lambda r: r["step"]) if r.get("expert_load")]
    if not rows:
        return None
    shape = np.shape(rows[0]["expert_load"])
    rows = [r for r in rows if np.shape(r["expert_load"]) == shape]  # skip lines from a differently shaped model
    steps = np.array([r["step"] for r in rows], dtype=float)
    load = np.array([r["expert_load"] for r in rows], dtype=float) * shape[1]
    return _bin_columns(steps, load)


def load_norm(vmax: float) -> TwoSlopeNorm:
    """White at 1.0 (balanced), blue below, red above; the red end at least 2x uniform."""
    return TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(2.0, vmax))


def draw_load_heatmap(ax: Axes, steps: np.ndarray, load_SE: np.ndarray, norm: TwoSlopeNorm) -> QuadMesh:
    """One MoE layer's load / uniform (steps x experts) as a heatmap in `ax`; returns the mesh for a colour bar."""
    n_experts = load_SE.shape[1]
    mesh = ax.pcolormesh(_edges(steps), np.arange(n_experts + 1) - 0.5, load_SE.T, cmap="RdBu_r", norm=norm,
                         rasterized=True)
    if n_experts <= 8:
        ax.set_yticks(range(n_experts))
    ax.tick_params(labelsize=8)
    return mesh


def plot_expert_load(run_dir: str | os.PathLike) -> Path | None:
    """Heatmap per MoE layer of expert load relative to uniform: shows collapse or imbalance over training."""
    train, _, _ = parse_metrics(_metrics_path(run_dir))
    found = expert_load_of(train)
    if found is None:
        return None
    steps, load = found
    _, n_layers, n_experts = load.shape
    norm = load_norm(float(np.nanmax(load)))
    panel_h = min(max(0.12 * n_experts + 0.6, 1.0), 2.2)
    fig = Figure(figsize=(9, min(1.4 + panel_h * n_layers, 40)), layout="constrained")
    axes = fig.subplots(n_layers, 1, sharex=True, squeeze=False)[:, 0]
    mesh = None
    for i, ax in enumerate(axes):
        mesh = draw_load_heatmap(ax, steps, load[:, i, :], norm)
        ax.set_ylabel(f"layer {i}\nexpert", fontsize=8)
    axes[-1].set_xlabel("step")
    axes[0].set_title(f"Expert load / uniform — {Path(run_dir).resolve().name} (1.0 = balanced)")
    # default aspect makes the bar height/20 wide, a slab on tall figures; keep it ~0.2 inch
    fig.colorbar(mesh, ax=list(axes), label="load / uniform", aspect=max(20.0, fig.get_figheight() / 0.2))
    return save_png(fig, own_folder(Path(run_dir), "plots") / "expert_load.png")


@dataclass
class Routing:
    """The routing telemetry of a run's val lines, as arrays against step."""

    steps: np.ndarray  # (V,) the validations' steps
    values: dict[str, np.ndarray]  # statistic -> (V, layers); NaN where a line lacks it
    n_layers: int  # MoE layers
    n_experts: int | None  # from the load table: the entropy's maximum is ln(n_experts)

    def has(self, *keys: str) -> bool:
        return all(key in self.values and np.isfinite(self.values[key]).any() for key in keys)


def _layers(block: dict) -> int:
    """The number of MoE layers a (validated, `_routing_ok`) routing block describes."""
    return len(next(v for k, v in block.items() if k in ("load", *routing_keys())))


def routing_of(val: list[dict]) -> Routing | None:
    """The "routing" blocks of the val lines (those with the first block's layer count), None if there are none."""
    rows = [r for r in sorted(val, key=lambda r: r["step"]) if r.get("routing")]
    if not rows:
        return None
    n_layers = _layers(rows[0]["routing"])
    rows = [r for r in rows if _layers(r["routing"]) == n_layers]
    values = {}
    for key in routing_keys():
        if any(key in r["routing"] for r in rows):
            values[key] = np.array([r["routing"].get(key, [np.nan] * n_layers) for r in rows], dtype=float)
    loads = [r["routing"]["load"] for r in rows if "load" in r["routing"]]
    return Routing(np.array([r["step"] for r in rows], dtype=float), values, n_layers,
                   len(loads[0][0]) if loads else None)


def routing_panels() -> list[tuple[str, str, tuple[str, ...], float]]:
    """The routing panels, one per declared statistic (`moe.ROUTING_STATISTICS`) and the statistics drawn in
    it (its `panel`): (title, y label, the keys drawn, the factor they are shown at)."""
    panels = []
    for stat in ROUTING_STATISTICS:
        if stat.panel is None:
            keys = (stat.name, *(s.name for s in ROUTING_STATISTICS if s.panel == stat.name))
            panels.append((stat.meaning, stat.unit, keys, stat.factor))
    return panels


def routing_axes(fig: Figure, panels: int) -> list[Axes]:
    """A grid of `panels` axes sharing the step axis, three to a row."""
    cols = min(panels, 3)
    rows = -(-panels // cols)
    grid = fig.subplots(rows, cols, sharex=True, squeeze=False).ravel()
    for ax in grid[panels:]:
        ax.set_visible(False)
    for i, ax in enumerate(grid[:panels]):
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
        if i >= panels - cols:  # the lowest visible axes of each column
            ax.set_xlabel("step", fontsize=9)
            ax.xaxis.set_tick_params(labelbottom=True)
    return list(grid[:panels])


def max_entropy_line(ax: Axes, n_experts: int) -> None:
    """The entropy of a router that cannot tell experts apart, ln E: dashed, named at its right end."""
    ax.axhline(math.log(n_experts), color="gray", ls="--", lw=1)
    ax.annotate(f"ln {n_experts}", (1, math.log(n_experts)), xycoords=("axes fraction", "data"), xytext=(-3, -3),
                textcoords="offset points", ha="right", va="top", fontsize=8, color="gray")


def layer_colours(n: int) -> list:
    """tab10 for up to ten layers (told apart by a legend), else viridis in layer order (told apart by a bar)."""
    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    return [matplotlib.colormaps["viridis"](i / (n - 1)) for i in range(n)]


def plot_routing(run_dir: str | os.PathLike) -> Path | None:
    """The router's health between validations, one line per MoE layer: how many slots overflowed (rerouted,
    dropped), how sure the router is (entropy), how far the balancing bias has moved and the balance and z
    losses. None when the val lines carry no routing (a dense run, or one from before the telemetry)."""
    _, val, _ = parse_metrics(_metrics_path(run_dir))
    routing = routing_of(val)
    panels = [p for p in routing_panels() if routing is not None and routing.has(*p[2])]
    if not panels:
        return None
    n_layers = routing.n_layers
    colours = layer_colours(n_layers)
    fig = Figure(figsize=(12, 3.2 * -(-len(panels) // 3) + 1.2), layout="constrained")
    x = routing.steps
    for ax, (title, ylabel, keys, factor) in zip(routing_axes(fig, len(panels)), panels, strict=True):
        for i in range(n_layers):
            for key in keys:  # the bias panel: its lowest and its highest value, each layer's two lines
                ax.plot(x, routing.values[key][:, i] * factor, ".-", ms=3, color=colours[i], lw=1.2)
        if keys == ("entropy",) and routing.n_experts:
            max_entropy_line(ax, routing.n_experts)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
    fig.suptitle(f"Routing — {Path(run_dir).resolve().name}: each MoE layer, averaged over the steps between "
                 "validations", fontsize=11)
    if n_layers <= 10:
        handles = [Line2D([], [], color=c, lw=2, label=f"MoE layer {i}") for i, c in enumerate(colours)]
        fig.legend(handles=handles, loc="outside lower center", ncol=min(n_layers, 8), fontsize=8, frameon=False)
    else:
        bar = ScalarMappable(norm=Normalize(0, n_layers - 1), cmap="viridis")
        fig.colorbar(bar, ax=fig.axes, label="MoE layer", location="bottom", shrink=0.5, aspect=40)
    return save_png(fig, own_folder(Path(run_dir), "plots") / "routing.png")


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write every plot that applies to this run into RUN/plots/ (never through a symlink planted there:
    `files.own_folder`): the losses, and for MoE runs the expert load and, when the val lines carry it, the
    routing telemetry. Lines of metrics.jsonl that are not records of ours are skipped, with one warning on
    stderr."""
    _, _, bad = parse_metrics(_metrics_path(run_dir))
    own_folder(Path(run_dir), "plots")  # refused before any figure is drawn
    if bad:
        print(f"warning: {bad} line(s) of {Path(run_dir) / 'metrics.jsonl'} are not step records (cut short or "
              "edited) and were skipped", file=sys.stderr)
    paths = [plot_losses(run_dir)]
    for plot in (plot_expert_load, plot_routing):
        path = plot(run_dir)
        if path is not None:
            paths.append(path)
    return paths
