"""A sweep's report, from OUT/results.json alone (so that it can be redrawn): table.md, a row per arm and a
verdict line per named pair, and sweep.png, the validation curves.

A loss means little without what it cost: each row shows the arm's steps per seed and its tokens beside its
loss. Under a time budget the steps an arm gets depend on the machine's load while it trains as much as on
the arm (the arms of one seed, timed in turn, trained 172, 129, 149 and 67 steps in a 40 s sweep), so a pair
whose arms saw amounts of text more than TOKENS_APART apart says so in its verdict line, with the reading at
the tokens both reached: without it, such a verdict reads like a per-token comparison and is not one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..model.memory import active_size_note, format_count
from . import common

TOKENS_APART = 0.10  # a pair whose arms' training tokens differ by more on a seed says so in its verdict line


def report(out: Path) -> list[Path]:
    """table.md (a row per arm, a paired line per named pair) and sweep.png (the validation curves), from
    results.json alone."""
    doc, results = common.load_results(out)
    sweep = doc["sweep"]
    rows = []
    for name in common.arm_names(doc):
        mine = sorted((r for r in results if r.name == name), key=lambda r: r.seed)
        if not mine:
            continue
        speeds = [r.tokens_per_s for r in mine]
        timed = doc.get("timed", {}).get(name)
        rows.append([name, format_count(mine[0].params_total), format_count(mine[0].params_active),
                     ", ".join(f"{r.steps:,}" for r in mine), format_count(round(common.mean(r.tokens for r in mine))),
                     spread(speeds), *([spread(timed, median=True)] if "timed" in doc else []),
                     common.per_seed(results, name), common.mean(r.full_val_loss for r in mine)])
    table = common.markdown_table(["arm", "params", "active", "steps per seed", "tokens (mean)",
                                   "tokens/s (mean, range over seeds)",
                                   *(["tokens/s timed in turn (median, range)"] if "timed" in doc else []),
                                   "full val loss per seed", "mean"], rows)
    best, lines = at_best(sweep, results)
    lines += [pair_line(results, best.get(a, a), best.get(b, b), by_time=not sweep["max_steps"],
                        at_best=a in best or b in best) for a, b in (tuple(p) for p in sweep["pairs"])]
    shown = dict(best) or {n: n for n in common.arm_names(doc)}  # (with cross: each file arm once, at its best)
    active = [(name, common.arm_counts(next(r for r in results if r.name == arm))) for name, arm in shown.items()
              if any(r.name == arm for r in results)]
    sized = active_size_note(active)  # "equal active parameters" that are not, by how much and why
    if sized:
        lines.append(f"- {sized[0].upper()}{sized[1:]}.")
    moved = speed_note(results, timed="timed" in doc)
    if moved:
        lines.append(moved)
    budget = f"{sweep['max_steps']:,} steps" if sweep["max_steps"] else f"{sweep['max_time']:g} s"
    when = (" Under a time budget an arm's steps depend on the machine's load while it trained as much as on the "
            "arm: sweep by steps (max_steps) to compare arms token for token." if not sweep["max_steps"] else "")
    text = (f"# {sweep['title']}\n\n{table}\n\n" + "\n".join(lines) +
            f"\n\nEach arm trained for {budget} per seed (seeds {', '.join(map(str, sweep['seeds']))}), "
            "scored by its full validation loss (nats/token)." + when + " Pairs are read seed by seed (same seed: "
            "same initialisation and batches): the mean difference and its 95% t-interval; better/worse when the "
            f"interval excludes 0, a tie when it lies within +-{common.EFFECT} nats, undecided otherwise (fewer "
            "than 3 seeds: undecided)." + (" Each arm's best value is chosen on the same validation loss the pairs "
                                           "then compare, which flatters every arm a little: the line of each says "
                                           "how far its next best trails." if best else ""))
    return [common.write_table(out, text), common.plot_curves(results, out / "sweep.png", sweep["title"])]


SPEED_APART = 0.20  # an arm whose tokens/s over its seeds spans more than this share of its mean gets a warning


def spread(values: list[float] | None, median: bool = False) -> str:
    """"mean (min-max)" (or the median) of tokens/s figures, rounded; "-" for none."""
    if not values:
        return "-"
    middle = sorted(values)[len(values) // 2] if median else common.mean(values)
    return f"{middle:,.0f} ({min(values):,.0f}-{max(values):,.0f})" if len(values) > 1 else f"{middle:,.0f}"


def speed_note(results: list[Any], timed: bool) -> str | None:
    """A line when some arm's tokens/s moved by more than SPEED_APART between its seeds: each run timed itself
    in its own minutes, so on a busy machine its speed says as much about the machine as about the arm."""
    worst, which = 0.0, ""
    for name in dict.fromkeys(r.name for r in results):
        speeds = [r.tokens_per_s for r in results if r.name == name]
        apart = (max(speeds) - min(speeds)) / common.mean(speeds) if len(speeds) > 1 else 0.0
        if apart > worst:
            worst, which = apart, name
    if worst <= SPEED_APART:
        return None
    fix = ("the timed-in-turn column measured the arms in the same minutes" if timed else
           "[sweep] time_steps = 10 times every arm's step in turn after training (A B A B), as a speed comparison "
           "needs")
    return (f"- Tokens/s moved by up to {worst:.0%} between one arm's seeds ({which}): the machine's load changed "
            f"while the sweep ran, so the training runs' speeds do not compare arms; {fix}.")


def pair_line(results: list[Any], a: str, b: str, by_time: bool, at_best: bool = False) -> str:
    """The report's line for pair (a, b): a minus b seed by seed, the mean's interval and its reading
    (`at_best`: arms of a [sweep] cross, each at its best value, which the line says)."""
    test = common.paired_test(common.paired(results, a, b))
    prefix = "at each one's best: " if at_best else ""
    return (f"- {prefix}{a} minus {b}, per seed {common.versus(test.diffs)}: {test.interval} -> **{test.reading}**"
            + unequal_tokens(results, a, b, by_time))


def at_best(sweep: dict[str, Any], results: list[Any]) -> tuple[dict[str, str], list[str]]:
    """With [sweep] cross: each arm of the file at its best value (lowest mean full validation loss over the
    seeds), as {arm: the crossed arm}, and a line per arm saying which and how sure that choice is: the best
    against the next best, seed by seed. The choice reads the same validation loss the pairs then compare,
    so each arm's best is a little flattered; the line says by how little the runner-up trails."""
    bases: dict[str, list[str]] = {}
    for arm in sweep["arms"]:
        if arm.get("base"):
            bases.setdefault(arm["base"], []).append(arm["name"])
    best, lines = {}, []
    for base, members in bases.items():
        means = {m: common.mean(r.full_val_loss for r in results if r.name == m) for m in members
                 if any(r.name == m for r in results)}
        ranked = sorted(means, key=means.get)
        if not ranked:
            continue
        best[base] = ranked[0]
        line = f"- {base} at its best, {ranked[0].removeprefix(base + ' ')}: mean {means[ranked[0]]:.4f}"
        if len(ranked) > 1:
            test = common.paired_test(common.paired(results, ranked[1], ranked[0]))
            line += (f"; the next, {ranked[1].removeprefix(base + ' ')}, per seed {common.versus(test.diffs)}: "
                     f"{test.interval} -> {test.reading}"
                     + (" (the choice itself is within the noise)" if test.reading in ("tie", "undecided") else ""))
        lines.append(line)
    return best, lines


def read_pairs(out: Path, pairs: list[str]) -> list[str]:
    """More pairs of a finished sweep (`nanollama4 sweep OUT --pairs A,B`), read from OUT/results.json alone,
    nothing trained: each "ARM,AGAINST" as the report's line. One ConfigError line for a name the sweep has
    not, listing its arms."""
    from ..base.errors import ConfigError

    if not (out / "results.json").is_file():
        raise ConfigError(f"{out} holds no results.json: --pairs reads a finished sweep's folder (train it with "
                          "`nanollama4 sweep FILE --out OUT` first)")
    doc, results = common.load_results(out)
    best, _ = at_best(doc["sweep"], results)
    names = common.arm_names(doc) + list(best)  # with cross, the file's arms too, read at their best
    lines = []
    for text in pairs:
        pair = next(((text[:i], text[i + 1:]) for i in range(len(text)) if text[i] == ","
                     and text[:i] in names and text[i + 1:] in names), None)  # (an arm's name may hold a comma)
        if pair is None:
            raise ConfigError(f"--pairs {text!r} takes ARM,AGAINST, two of the sweep's arms: {', '.join(names)}")
        a, b = pair
        lines.append(pair_line(results, best.get(a, a), best.get(b, b), by_time=not doc["sweep"]["max_steps"],
                               at_best=a in best or b in best))
    return lines


def unequal_tokens(results: list[Any], a: str, b: str, by_time: bool) -> str:
    """What pair (a, b)'s verdict line adds when on some seed their training tokens differ by more than
    TOKENS_APART: the steps each trained, by how much the tokens differ, why that matters, and the difference
    of their fixed-batch validation loss at the tokens both reached (mean over seeds); "" otherwise."""
    mine = {r.seed: r for r in results if r.name == a}
    theirs = {r.seed: r for r in results if r.name == b}
    seeds = [s for s in sorted(mine) if s in theirs]
    apart = max((abs(mine[s].tokens - theirs[s].tokens) / max(mine[s].tokens, theirs[s].tokens, 1)
                 for s in seeds), default=0.0)
    if apart <= TOKENS_APART:
        return ""
    steps = [round(common.mean(side[s].steps for s in seeds)) for side in (mine, theirs)]
    why = ("the comparison measures this machine's speed and load as much as the arms; sweep by steps "
           "(max_steps) for a per-token comparison" if by_time else "the arms take different tokens per step, so "
           "the comparison is per step, not per token")
    at_equal = []
    for s in seeds:
        curves = [side[s].val_curve for side in (mine, theirs)]
        if all(curves):
            x = min(c[-1]["tokens"] for c in curves)
            at_equal.append(common.loss_at(curves[0], "tokens", x) - common.loss_at(curves[1], "tokens", x))
    equal = common.mean(d for d in at_equal if not math.isnan(d))
    seeds_word = " (mean over seeds)" if len(seeds) > 1 else ""
    return (f"; trained {steps[0]:,} vs {steps[1]:,} steps{seeds_word}, tokens differ by up to {apart:.0%}: {why}"
            + ("" if math.isnan(equal) else f"; at the tokens both reached, the fixed validation batches read "
                                            f"{equal:+.4f}{seeds_word}"))


def paired_lines(out: Path) -> list[str]:
    """The report's paired lines (and the line saying when arms differ in active size), as printed after a
    sweep."""
    text = (out / "table.md").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.startswith("- ") and (
        " minus " in line or line.startswith(("- Active parameters", "- Tokens/s moved")) or " at its best, " in line)]
