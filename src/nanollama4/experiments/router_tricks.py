"""Experiment 5, the router's training tricks: do they keep experts from going under-trained?

The tutorial's router (softmax, top-2 of 8 experts of 192, no shared expert), trained with one trick
changed at a time: none; learned or fixed noise on the logits; the softmax over all logits instead of
-inf masking of the non-top-k; an expert capacity of 1.0 or 1.25 with overflow to the next-best expert,
or the same capacity dropping the overflow; the Switch auxiliary loss; bias balancing. For each: the
per-expert load over training (a heatmap of the first MoE layer), the experts that end below 10% of
their fair share (over the last tenth of training, all layers), and the validation loss. The baseline
gets every seed, the others too when their first seed is within its spread.
"""

from __future__ import annotations

from pathlib import Path

from . import common
from .sweep import Sweep, setting_of

TITLE = "router tricks: per-expert load over training"
N_EXPERTS = 8


def starved(load: list[list[list[float]]], fair: float, below: float = 0.1) -> tuple[int, int]:
    """(experts under `below` of the fair share, experts in all) over the last tenth of the logged steps,
    the load of each expert averaged over those steps."""
    tail = load[-max(1, len(load) // 10):]
    layers, experts = len(tail[0]), len(tail[0][0])
    mean = [[sum(step[i][e] for step in tail) / len(tail) for e in range(experts)] for i in range(layers)]
    return sum(v < below * fair for row in mean for v in row), layers * experts


def run(out: Path, sweep: Sweep, results: list[common.ArmResult], progress: bool = True, tiny: bool = False
        ) -> list[Path]:
    """Write results.json (the arms the sweep trained, `results`), table.md and the plot."""
    return [common.save(out, "router_tricks", setting_of(sweep, tiny), results, {"sweep": sweep.to_dict()}),
            *report(out)]


def report(out: Path) -> list[Path]:
    """table.md and the heatmaps, from results.json."""
    doc, results = common.load_results(out)
    first_seed = doc["setting"]["seeds"][0]
    names = common.arm_names(doc)
    base = names[0]
    tie, repeated = common.largest_spread(results)
    rows = []
    for name in names:
        first = next(r for r in results if r.name == name and r.seed == first_seed)
        n, total = starved(first.expert_load, 1 / N_EXPERTS)
        rows.append([name, f"{n} of {total}", max(max(row) for row in first.expert_load[-1]) * N_EXPERTS,
                     common.per_seed(results, name), *common.paired_cells(results, name, base)])
    table = common.markdown_table(["arm", "experts under 10% of fair share (last tenth)",
                                   "busiest expert at the end (x fair)", "full val loss per seed",
                                   "minus no tricks, per seed", "mean [95% CI]", "reading"], rows)
    table += (f"\n\n{common.paired_note(first_seed, base)} Seed-to-seed spread of the raw losses (largest of "
              f"{', '.join(repeated)}): {common.format_spread(tie)}; load columns from seed {first_seed}.")
    plots = []
    for part, chunk in enumerate((names[:5], names[5:]), start=1):
        fig, axes = common.figure(len(chunk), width=3.2, height=3.0)
        for ax, name in zip(axes, chunk, strict=True):
            load = next(r for r in results if r.name == name and r.seed == first_seed).expert_load
            grid = [[step[0][e] * N_EXPERTS for step in load] for e in range(N_EXPERTS)]  # layer 0, x fair
            image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=3, interpolation="nearest")
            ax.set(title=name, xlabel="step", ylabel="expert", yticks=range(N_EXPERTS))
        fig.colorbar(image, ax=axes[-1], label="first layer's load (x fair share)")
        plots.append(common.save_figure(fig, out / f"router_tricks_load_{part}.png"))
    return [common.write_table(out, table), *plots]
