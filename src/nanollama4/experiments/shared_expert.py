"""Experiment 2, the shared expert: does an always-on expert spare the routed ones from relearning what
every token needs?

At equal active parameters (384 per token) and nearly equal totals: top-1 of 8 routed experts of 192
plus a shared expert of 192, against top-2 of 8 routed experts of 192 and no shared expert. Every seed
for both.
"""

from __future__ import annotations

from pathlib import Path

from . import common
from .sweep import Sweep, setting_of

TITLE = "shared expert on / off"


def run(out: Path, sweep: Sweep, results: list[common.ArmResult], progress: bool = True, tiny: bool = False
        ) -> list[Path]:
    """Write results.json (the arms the sweep trained, `results`), table.md and the plot."""
    return [common.save(out, "shared_expert", setting_of(sweep, tiny), results, {"sweep": sweep.to_dict()}),
            *report(out)]


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    doc, results = common.load_results(out)
    first = doc["setting"]["seeds"][0]
    names = common.arm_names(doc)
    tie, _ = common.largest_spread(results)
    rows = []
    for name in names:
        mine = [r for r in results if r.name == name]
        rows.append([name, mine[0].params_total, mine[0].params_active, common.per_seed(results, name),
                     common.mean(r.full_val_loss for r in mine), *common.paired_cells(results, name, names[0])])
    table = common.markdown_table(["arm", "params", "active", "full val loss per seed", "mean (same seeds)",
                            "minus shared on, per seed", "mean [95% CI]", "reading"], rows)
    table += (f"\n\n{common.paired_note(first, names[0])} Seed-to-seed spread of the raw losses (largest of the two "
              f"arms): {common.format_spread(tie)}.")
    return [common.write_table(out, table), common.plot_curves(results, out / "shared_expert.png", TITLE)]
