"""Experiment 2, the shared expert: does an always-on expert spare the routed ones from relearning what
every token needs?

At equal active parameters (384 per token) and nearly equal totals: top-1 of 8 routed experts of 192
plus a shared expert of 192, against top-2 of 8 routed experts of 192 and no shared expert. Two seeds
each.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    ArmResult,
    Setting,
    base_model,
    markdown_table,
    mean_loss,
    plot_curves,
    save,
    spread,
    train_arm,
    verdict,
)

TITLE = "shared expert on / off"
STEPS = 800  # optimizer steps per arm (of 16 x 128 characters)


def arms() -> list[tuple[str, object]]:
    return [("shared on (k=1 + shared)", base_model(n_experts=8, expert_dim=192)),
            ("shared off (k=2)", base_model(n_experts=8, experts_per_token=2, expert_dim=192, shared_expert=False))]


def run(out: Path, setting: Setting, progress: bool = True) -> list[Path]:
    results: list[ArmResult] = [train_arm(name, cfg, setting, out, seed, progress)
                                for name, cfg in arms() for seed in setting.seeds]
    names = [name for name, _ in arms()]
    tie = max(spread(results, n) for n in names)
    base = mean_loss(results, names[0])
    rows = []
    for name in names:
        mine = [r for r in results if r.name == name]
        loss = mean_loss(results, name)
        per_seed = ", ".join(f"{r.full_val_loss:.4f}" for r in mine)
        rows.append([name, mine[0].params_total, mine[0].params_active, per_seed, loss, loss - base,
                     verdict(loss - base, tie)])
    table = markdown_table(["arm", "params", "active", "full val loss per seed", "mean", "vs shared on", "reading"],
                           rows)
    table += f"\n\nseed-to-seed spread (largest of the two arms): {tie:.4f}; differences up to it are ties"
    plot = plot_curves(results, out / "shared_expert.png", TITLE)
    return [save(out, "shared_expert", setting, results, table, {"tie_below": tie}), plot]
