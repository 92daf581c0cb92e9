"""The learning-rate schedule: a linear warmup to each param group's peak, then a cosine down to min_lr / lr of
it, counted in steps (--max-steps) or on the clock (--max-time).

The schedule is one share of the peak (`lr_scale`) that every param group takes at once; the peaks are the
optimizer kind's (`optim.OptimizerKind.peak_lr`: lr for AdamW's groups, muon.lr for Muon's). Both are read
from the config each step, never from the optimizer's saved groups, so a resume may change either.
"""

from __future__ import annotations

import math

import torch

from ..base.config import TrainConfig
from .optim import optimizer_kind


def lr_scale(tc: TrainConfig, step: int, elapsed: float, step_time: float = 0.0) -> float:
    """The schedule's share of the peak learning rate for the step about to run: a linear warmup from 0 to
    1, then a cosine down to min_lr / lr.

    The schedule follows the budget that was given. Under --max-steps it is counted in steps (warmup_steps,
    then a cosine over decay_steps or max_steps); under --max-time in seconds (warmup over warmup_frac of
    the budget, then a cosine over the rest), so a slow machine spends the same share of its budget warming
    up as a fast one. `elapsed` is the clock at the step's start and `step_time` the last step's duration: the
    warmup reads the clock at the step's expected end, so the first step does not run at lr 0. With both
    budgets each phase ends with whichever budget reaches it first."""
    warm, progress = [], []
    if tc.max_time:
        warm_time = tc.warmup_frac * tc.max_time
        warm.append(min(1.0, (elapsed + step_time) / warm_time) if warm_time > 0 else 1.0)
        progress.append((elapsed - warm_time) / (tc.max_time - warm_time))
    horizon = tc.decay_steps or tc.max_steps
    if horizon or not tc.max_time:
        warm.append(min(1.0, (step + 1) / tc.warmup_steps) if tc.warmup_steps else 1.0)
        if horizon:
            progress.append((step - tc.warmup_steps) / max(1, horizon - tc.warmup_steps))
    if max(warm) < 1.0:
        return max(warm)
    p = min(1.0, max(0.0, *progress)) if progress else 0.0
    floor = tc.min_lr / tc.lr if tc.lr > 0 else 0.0
    return floor + 0.5 * (1 - floor) * (1 + math.cos(math.pi * p))


def logged_lr(tc: TrainConfig, scale: float) -> float:
    """The "lr" of a metrics.jsonl line for a step taken at `scale` of the peaks: tc.lr's share (the AdamW
    groups'; every other group takes the same share of its own peak)."""
    return tc.lr * scale


def peak_lrs(optimizer: torch.optim.Optimizer, tc: TrainConfig) -> list[float]:
    """Each param group's peak learning rate, as the optimizer kind tc names gives it."""
    kind = optimizer_kind(tc.optimizer)
    return [kind.peak_lr(group, tc) for group in optimizer.param_groups]


def set_lr(optimizer: torch.optim.Optimizer, tc: TrainConfig, scale: float) -> None:
    """Every group's learning rate at `scale` (the schedule's share, `lr_scale`) of its peak (`peak_lrs`)."""
    for group, peak in zip(optimizer.param_groups, peak_lrs(optimizer, tc), strict=True):
        group["lr"] = scale * peak
