"""What a run logs: metrics.jsonl (and TensorBoard events beside it), and the routing telemetry its lines carry.

Each training step writes one line (`train.log_step`): losses, lr, gradient norm, throughput and, for an MoE,
each layer's expert load in that step (`expert_load`). Each validation writes one line with the validation
loss and a "routing" block: the load shares and every declared routing statistic
(`moe.ROUTING_STATISTICS`: the per-step ones as means over the steps since the last validation, the
balancing bias's range as it is then; `Telemetry`). With log=tensorboard the same numbers go to TensorBoard too
(`board_scalars`). metrics.jsonl is the record `plots`, `compare` and the experiments read: its names
and rounding are a format.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base.config import TrainConfig
from ..base.errors import TrainingError
from ..base.files import open_owned, own_folder, write_failed
from ..model.moe import ROUTING_STATISTICS, RoutingStatistic
from ..model.transformer import Transformer


class MetricsFile:
    """metrics.jsonl, appended to without following a planted symlink; a write that fails (a full disk) is
    a WriteError naming the file, the checkpoints being intact. Without a path (ranks other than 0) writes
    go nowhere. With `tensorboard` (a folder of ours) every record's numbers also go to TensorBoard events
    there, the steps past `step` (a resume's) replacing what an earlier process logged."""

    def __init__(self, path: Path | None, run_dir: Path, tensorboard: Path | None = None, step: int = 0) -> None:
        self.path, self.run_dir = path, run_dir
        self.file = open_owned(path) if path is not None else open(os.devnull, "a")
        self.board = None
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(tensorboard), purge_step=step + 1 if step else None)

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.file.close()
            if self.board is not None:
                self.board.close()
        except OSError:
            pass  # the error that matters was raised by write or flush

    def record(self, line: dict) -> None:
        """One line of metrics.jsonl (and its numbers as TensorBoard scalars)."""
        self.write(json.dumps(line) + "\n")
        if self.board is not None:
            for tag, value in board_scalars(line):
                self.board.add_scalar(tag, value, line["step"])

    def write(self, text: str) -> None:
        self._guarded(self.file.write, text)

    def flush(self) -> None:
        self._guarded(self.file.flush)
        if self.board is not None:
            self._guarded(self.board.flush)

    def _guarded(self, call, *args) -> None:
        try:
            call(*args)
        except OSError as e:
            raise write_failed(self.path, e, f"the last checkpoint in {self.run_dir} is kept: make room and "
                               f"continue with --resume {self.run_dir}") from None


@dataclass
class StepResult:
    lm: float  # mean next-token loss over the step's micro-batches
    aux: float  # mean MoE auxiliary loss
    grad_norm: float  # before clipping
    counts: torch.Tensor | None  # (layers, experts) assignments in the last micro-batch, summed over ranks
    routing: torch.Tensor | None = None  # (layers, statistics) the last micro-batch's `routing_stats`, rank mean


def expert_counts(model: Transformer) -> torch.Tensor | None:
    """(layers, experts): the routed assignments each expert got in the last forward pass, None without MoE."""
    counts = [c for c in (m.counts for m in model.moe_layers()) if c is not None]
    return torch.stack(counts).float() if counts else None


def pooled(kind: str) -> list[RoutingStatistic]:
    """The declared routing statistics (`moe.ROUTING_STATISTICS`) pooled as `kind`: "mean" (each training
    step's value, averaged between validations) or "now" (read at the validation)."""
    return [s for s in ROUTING_STATISTICS if s.pooled == kind]


def routing_stats(model: Transformer) -> torch.Tensor | None:
    """(layers, per-step statistics): each MoE layer's `pooled("mean")` statistics in the last training pass
    (NaN for one without a value then), None without MoE."""
    stats = pooled("mean")
    if not stats:
        return None
    rows = []
    for moe in model.moe_layers():
        if moe.last is None:
            continue
        values = [s.read(moe) for s in stats]
        nan = moe.router.expert_bias.new_full((), float("nan"))
        rows.append(torch.stack([(nan if v is None else v).float().reshape(()) for v in values]))
    return torch.stack(rows) if rows else None


@dataclass
class Telemetry:
    """The routing of the steps since the last validation, summed; `take` turns it into the validation
    line's "routing" block (means over those steps) and starts again."""

    counts: torch.Tensor | None = None  # (layers, experts) assignments
    sums: torch.Tensor | None = None  # (layers, the per-step statistics: `pooled("mean")`)
    steps: int = 0

    def add(self, result: StepResult) -> None:
        if result.counts is None or result.routing is None:
            return
        first = self.counts is None
        self.counts = result.counts.double() if first else self.counts + result.counts.double()
        self.sums = result.routing.double() if first else self.sums + result.routing.double()
        self.steps += 1

    def take(self, model: Transformer) -> dict | None:
        """Per MoE layer: the expert-load shares, each per-step statistic's mean over the steps taken, and the
        statistics read now (the balancing bias's range); None when no step was counted (or no MoE)."""
        if not self.steps:
            return None
        block = {"load": [[round(v, 4) for v in row] for row in expert_load(self.counts)]}
        means = (self.sums / self.steps).T.tolist()  # (statistics, layers)
        for stat, values in zip(pooled("mean"), means, strict=True):
            if all(math.isfinite(v) for v in values):
                block[stat.name] = [round(v, 6) for v in values]
        with torch.no_grad():
            for stat in pooled("now"):
                values = [stat.read(m) for m in model.moe_layers()]
                if all(v is not None for v in values):
                    block[stat.name] = [round(float(v), 6) for v in values]
        self.counts, self.sums, self.steps = None, None, 0
        return block


def board_scalars(line: dict) -> Iterator[tuple[str, float]]:
    """A metrics.jsonl line's numbers as TensorBoard (tag, value) pairs: the losses and rates under train/,
    the validation loss under val/, each MoE layer's routing under routing/layerN/ (the most and least
    loaded expert over uniform stand for the load shares)."""
    for key, value in line.items():
        if key in ("step", "time", "tokens") or not isinstance(value, int | float):
            continue
        yield ("val/" if key == "val_loss" else "train/") + key, float(value)
    routing = line.get("routing") or {}
    for name, values in routing.items():
        if name == "load":
            for i, shares in enumerate(values):
                yield f"routing/layer{i}/max_load", max(shares) * len(shares)
                yield f"routing/layer{i}/min_load", min(shares) * len(shares)
        else:
            for i, value in enumerate(values):
                yield f"routing/layer{i}/{name}", float(value)


def expert_load(counts: torch.Tensor | None) -> list[list[float]]:
    """Per MoE layer, each expert's fraction of the routed assignments in `counts` (from `expert_counts`)."""
    if counts is None:
        return []
    return (counts / counts.sum(-1, keepdim=True)).tolist()


def tensorboard_dir(run_dir: Path, resume: bool) -> Path:
    """RUN/tensorboard/, a folder of ours (never through a planted link). A new run starts it empty."""
    folder = own_folder(run_dir, "tensorboard")
    if not resume:
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
    return folder


def check_log(tc: TrainConfig) -> None:
    """log=tensorboard needs the tensorboard package: say so before anything starts."""
    if tc.log == "tensorboard":
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise TrainingError("log=tensorboard needs the tensorboard package: pip install 'nanollama4[tensorboard]' "
                                "(or --set log=jsonl)")
