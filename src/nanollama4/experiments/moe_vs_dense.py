"""Experiment 1, MoE against dense: does capacity grow with N while compute follows k?

Every arm has the same active feed-forward width (384 per token): the dense FFN of 384; top-1 of N
routed experts of 192 plus a shared expert of 192, for N in 4, 8, 16, 32; and top-2 of 8 experts of 128
plus a shared one of 128. Same steps, and per seed the same initialisation seed and batches; the dense
model and N = 8 with every seed (the spread), the other arms again with the other seeds when their
first seed's difference is within 3x the dense model's spread; each arm read by its paired
differences from dense (mean and 95% t-interval). Validation loss against tokens seen and against time.
"""

from __future__ import annotations

from pathlib import Path

from . import common
from .sweep import Sweep, setting_of

TITLE = "MoE vs dense at equal active parameters"
BASE = "dense"


def run(out: Path, sweep: Sweep, results: list[common.ArmResult], progress: bool = True, tiny: bool = False
        ) -> list[Path]:
    """Write results.json (the arms the sweep trained, `results`), table.md and the plot."""
    return [common.save(out, "moe_vs_dense", setting_of(sweep, tiny), results, {"sweep": sweep.to_dict()}),
            *report(out)]


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    doc, results = common.load_results(out)
    first = doc["setting"]["seeds"][0]
    tie, repeated = common.largest_spread(results)
    names = common.arm_names(doc)
    speed = {name: common.mean(r.tokens_per_s for r in results if r.name == name) for name in names}
    equal_time = min(r.val_curve[-1]["time"] for r in results)  # the quickest arm's whole run
    rows = []
    for name in names:
        mine = sorted((r for r in results if r.name == name), key=lambda r: r.seed)
        rows.append([name, mine[0].params_total, mine[0].params_active, common.per_seed(results, name),
                     *common.paired_cells(results, name, BASE), speed[name] / speed[BASE],
                     ", ".join(f"{common.loss_at(r.val_curve, 'time', equal_time):.4f}" for r in mine)])
    table = common.markdown_table(["arm", "params", "active", "full val loss per seed", f"minus {BASE}, per seed",
                                   "mean [95% CI]", "reading (by tokens)", "speed vs dense",
                                   f"val loss at {equal_time:.0f} s, per seed"], rows)
    table += (f"\n\nseeds {', '.join(map(str, doc['setting']['seeds']))}. {common.paired_note(first, BASE)} "
              f"Seed-to-seed spread of the raw losses (largest of {', '.join(repeated)}): "
              f"{common.format_spread(tie)}. Speed and time count training steps only (no evaluations, no "
              "checkpoints). The last column is the "
              "fixed-batch validation loss when the quickest arm had finished its steps (interpolated between "
              "evaluations).")
    return [common.write_table(out, table), common.plot_curves(results, out / "moe_vs_dense.png", TITLE)]
