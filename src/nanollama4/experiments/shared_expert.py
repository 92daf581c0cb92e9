"""Experiment 2, the shared expert: does an always-on expert spare the routed ones from relearning what
every token needs?

At equal active parameters (384 per token) and nearly equal totals: top-1 of 8 routed experts of 192
plus a shared expert of 192, against top-2 of 8 routed experts of 192 and no shared expert. Every seed
for both.
"""

from __future__ import annotations

from pathlib import Path

from ..config import ModelConfig
from .common import (
    Setting,
    base_model,
    format_spread,
    largest_spread,
    load_results,
    markdown_table,
    mean,
    paired,
    per_seed,
    plot_curves,
    save,
    train_with_repeats,
    verdict,
    write_table,
)

TITLE = "shared expert on / off"
STEPS = 800  # optimizer steps per arm (of 16 x 128 characters)


def arms() -> list[tuple[str, ModelConfig]]:
    return [("shared on (k=1 + shared)", base_model(n_experts=8, expert_dim=192)),
            ("shared off (k=2)", base_model(n_experts=8, experts_per_token=2, expert_dim=192, shared_expert=False))]


def run(out: Path, setting: Setting, progress: bool = True) -> list[Path]:
    """Train every arm into OUT/runs, then write results.json, table.md and the plot."""
    names = [name for name, _ in arms()]
    results = train_with_repeats(arms(), names[0], setting, out, progress, always=names)
    return [save(out, "shared_expert", setting, results), *report(out)]


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    _, results = load_results(out)
    names = [name for name, _ in arms()]
    tie, _ = largest_spread(results)
    rows = []
    for name in names:
        mine = [r for r in results if r.name == name]
        diffs = paired(results, name, names[0])
        versus = "-" if name == names[0] else ", ".join(f"{d:+.4f}" for d in diffs)
        rows.append([name, mine[0].params_total, mine[0].params_active, per_seed(results, name),
                     mean(r.full_val_loss for r in mine), versus,
                     "baseline" if name == names[0] else verdict(mean(diffs), tie)])
    table = markdown_table(["arm", "params", "active", "full val loss per seed", "mean (same seeds)",
                            "minus shared on, per seed", "reading"], rows)
    table += (f"\n\nseed-to-seed spread (largest of the two arms): {format_spread(tie)}; a mean difference up "
              "to it is a tie")
    return [write_table(out, table), plot_curves(results, out / "shared_expert.png", TITLE)]
