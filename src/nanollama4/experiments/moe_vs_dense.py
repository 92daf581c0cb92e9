"""Experiment 1, MoE against dense: does capacity grow with N while compute follows k?

Every arm has the same active feed-forward width (384 per token): the dense FFN of 384; top-1 of N
routed experts of 192 plus a shared expert of 192, for N in 4, 8, 16, 32; and top-2 of 8 experts of 128
plus a shared one of 128. Same steps, same batches, two seeds each for the dense model and N = 8 (the
spread). Validation loss against tokens seen and against wall-clock.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    ArmResult,
    Setting,
    base_model,
    loss_at,
    markdown_table,
    mean_loss,
    plot_curves,
    save,
    spread,
    train_arm,
    verdict,
)

TITLE = "MoE vs dense at equal active parameters"
STEPS = 800  # optimizer steps per arm (of 16 x 128 characters)


def arms() -> list[tuple[str, object, bool]]:
    """(name, model config, repeated with every seed)."""
    out = [("dense", base_model(), True)]
    for n in (4, 8, 16, 32):
        out.append((f"moe N={n} k=1", base_model(n_experts=n, expert_dim=192), n == 8))
    out.append(("moe N=8 k=2", base_model(n_experts=8, experts_per_token=2, expert_dim=128), False))
    return out


def run(out: Path, setting: Setting, progress: bool = True) -> list[Path]:
    results: list[ArmResult] = []
    for name, cfg, repeated in arms():
        for seed in setting.seeds if repeated else setting.seeds[:1]:
            results.append(train_arm(name, cfg, setting, out, seed, progress))
    tie = max(spread(results, "dense"), spread(results, "moe N=8 k=1"))
    base = mean_loss(results, "dense")
    base_speed = _mean(r.tokens_per_s for r in results if r.name == "dense")
    equal_time = min(r.val_curve[-1]["time"] for r in results)  # the quickest arm's whole run
    rows = []
    for name, _, _ in arms():
        mine = [r for r in results if r.name == name]
        loss = mean_loss(results, name)
        rows.append([name, mine[0].params_total, mine[0].params_active, len(mine), loss, loss - base,
                     verdict(loss - base, tie), _mean(r.tokens_per_s for r in mine),
                     _mean(r.tokens_per_s for r in mine) / base_speed,
                     _mean(loss_at(r.val_curve, "time", equal_time) for r in mine)])
    table = markdown_table(["arm", "params", "active", "seeds", "full val loss", "vs dense", "reading",
                            "tokens/s", "speed vs dense", f"val loss at {equal_time:.0f} s"], rows)
    table += f"\n\nseed-to-seed spread (largest of dense, N=8): {tie:.4f}; differences up to it are ties"
    plot = plot_curves(results, out / "moe_vs_dense.png", TITLE)
    return [save(out, "moe_vs_dense", setting, results, table, {"tie_below": tie}), plot]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
