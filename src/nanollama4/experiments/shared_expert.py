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
    paired_note,
    paired_reading,
    per_seed,
    plot_curves,
    save,
    train_with_repeats,
    versus,
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
    doc, results = load_results(out)
    first = doc["setting"]["seeds"][0]
    names = [name for name, _ in arms()]
    tie, _ = largest_spread(results)
    rows = []
    for name in names:
        mine = [r for r in results if r.name == name]
        test = paired_reading(results, name, names[0])
        rows.append([name, mine[0].params_total, mine[0].params_active, per_seed(results, name),
                     mean(r.full_val_loss for r in mine), "-" if name == names[0] else versus(test.diffs),
                     "-" if name == names[0] else test.interval, "baseline" if name == names[0] else test.reading])
    table = markdown_table(["arm", "params", "active", "full val loss per seed", "mean (same seeds)",
                            "minus shared on, per seed", "mean [95% CI]", "reading"], rows)
    table += (f"\n\n{paired_note(first, names[0])} Seed-to-seed spread of the raw losses (largest of the two "
              f"arms): {format_spread(tie)}.")
    return [write_table(out, table), plot_curves(results, out / "shared_expert.png", TITLE)]
