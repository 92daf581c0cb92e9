"""Experiment 1, MoE against dense: does capacity grow with N while compute follows k?

Every arm has the same active feed-forward width (384 per token): the dense FFN of 384; top-1 of N
routed experts of 192 plus a shared expert of 192, for N in 4, 8, 16, 32; and top-2 of 8 experts of 128
plus a shared one of 128. Same steps, and per seed the same initialisation seed and batches; the dense
model and N = 8 with every seed (the spread). Validation loss against tokens seen and against
wall-clock.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    Setting,
    base_model,
    load_results,
    loss_at,
    markdown_table,
    mean_loss,
    paired,
    per_seed,
    plot_curves,
    save,
    spread,
    train_arm,
    verdict,
    write_table,
)

TITLE = "MoE vs dense at equal active parameters"
STEPS = 800  # optimizer steps per arm (of 16 x 128 characters)
BASE = "dense"


def arms() -> list[tuple[str, object, bool]]:
    """(name, model config, repeated with every seed)."""
    out = [(BASE, base_model(), True)]
    for n in (4, 8, 16, 32):
        out.append((f"moe N={n} k=1", base_model(n_experts=n, expert_dim=192), n == 8))
    out.append(("moe N=8 k=2", base_model(n_experts=8, experts_per_token=2, expert_dim=128), False))
    return out


def run(out: Path, setting: Setting, progress: bool = True) -> list[Path]:
    results = [train_arm(name, cfg, setting, out, seed, progress)
               for name, cfg, repeated in arms() for seed in (setting.seeds if repeated else setting.seeds[:1])]
    return [save(out, "moe_vs_dense", setting, results), *report(out)]


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    _, results = load_results(out)
    repeated = [name for name, _, again in arms() if again]
    tie = max(spread(results, name) for name in repeated)
    speed = {name: _mean(r.tokens_per_s for r in results if r.name == name) for name, _, _ in arms()}
    equal_time = min(r.val_curve[-1]["time"] for r in results)  # the quickest arm's whole run
    rows = []
    for name, _, _ in arms():
        mine = [r for r in results if r.name == name]
        diffs = paired(results, name, BASE)
        diff = _mean(diffs) if name != BASE else float("nan")
        rows.append([name, mine[0].params_total, mine[0].params_active, per_seed(results, name),
                     mean_loss(results, name), ", ".join(f"{d:+.4f}" for d in diffs) if name != BASE else "-",
                     verdict(diff, tie) if name != BASE else "baseline", speed[name] / speed[BASE],
                     ", ".join(f"{loss_at(r.val_curve, 'time', equal_time):.4f}"
                               for r in sorted(mine, key=lambda r: r.seed))])
    table = markdown_table(["arm", "params", "active", "full val loss per seed", "mean", "minus dense, per seed",
                            "reading (by tokens)", "speed vs dense", f"val loss at {equal_time:.0f} s, per seed"], rows)
    table += (f"\n\nseed-to-seed spread (largest of {', '.join(repeated)}): {tie:.4f}; a mean difference up to it "
              "is a tie. The last column is the fixed-batch validation loss at the wall-clock the quickest arm "
              "took for all its steps (interpolated between evaluations).")
    return [write_table(out, table), plot_curves(results, out / "moe_vs_dense.png", TITLE)]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")
