"""Experiment 6, MoE where capacity is short: does a routed model gain over a dense one as N grows, once the
dense model has stopped improving?

Experiment 1's arms stop long before a model of their size runs out of room for what Shakespeare has to
teach; an MoE adds parameters (capacity) at the compute of its active size, which can only pay where
capacity is short. So here the dense model is small (width 64, 2 layers, an FFN of 128) and trains long
enough for its validation curve to flatten, against MoEs of the same active size: top-1 of N experts of
64 plus a shared expert of 64, N = 4, 16 and 64 (so 2.5x, 8.5x and 32.5x the FFN parameters). Every arm
gets every seed (three by default): the paired differences per seed, at several points of the run, give
the gain as a function of N and of tokens seen. The published result to read it against: routed gains
grow with N and persist at small scale (Switch Transformer, Fedus et al. 2021; Clark et al. 2022,
"Unified Scaling Laws for Routed Language Models").

Then one BPE pair: dense and the N with the lowest mean loss, both with a byte-level BPE tokenizer of 512
tokens, where each token carries more to remember (their losses are per BPE token, compared only with
each other).

Rerun into the same folder with the same options, an interrupted experiment continues where it stopped.
"""

from __future__ import annotations

from pathlib import Path

from . import common
from .sweep import Sweep, setting_of

TITLE = "MoE where capacity is short"
BASE = "dense"
NS = (4, 16, 64)
BPE_VOCAB = 512
FRACTIONS = (0.25, 0.5, 1.0)  # points of the run at which the gain is read
FLAT = 0.02  # nats: dense has flattened when its last third of training gains less than this


def run(out: Path, sweep: Sweep, results: list[common.ArmResult], progress: bool = True, tiny: bool = False
        ) -> list[Path]:
    """After the sweep's arms (`results`, every seed), the BPE pair; then results.json, table.md and the plots."""
    best = min(NS, key=lambda n: common.mean(r.full_val_loss for r in results if r.name == f"moe N={n}"))
    bpe = {"tokenizer": "bpe", "bpe_vocab_size": BPE_VOCAB}
    arms = {arm.name: arm for arm in sweep.arms}
    for seed in sweep.seeds:
        for name, arm in ((f"{BASE} (BPE)", arms[BASE]), (f"moe N={best} (BPE)", arms[f"moe N={best}"])):
            model, tc = sweep.configs(arm, tiny)
            tc = tc.replace(seed=seed, max_steps=sweep.max_steps, warmup_steps=min(tc.warmup_steps, sweep.max_steps),
                            **bpe)
            results.append(common.train_run(name, model, tc, out, progress, setting_of(sweep, tiny).data,
                                            sweep.score_tokens))
    return [common.save(out, "moe_capacity", setting_of(sweep, tiny), results,
                        {"best_n": best, "sweep": sweep.to_dict()}), *report(out)]


def gains(results: list[common.ArmResult], name: str, fraction: float, key: str = "tokens", at: float | None = None
          ) -> list[float]:
    """Arm `name` minus dense on each seed, in fixed-batch validation loss at `fraction` of the run's tokens
    (or, with key "time", at `at` seconds of training steps)."""
    base = {r.seed: r for r in results if r.name == BASE}
    out = []
    for r in sorted((r for r in results if r.name == name), key=lambda r: r.seed):
        if r.seed in base and r.val_curve:
            x = fraction * r.val_curve[-1][key] if at is None else at
            out.append(common.loss_at(r.val_curve, key, x) - common.loss_at(base[r.seed].val_curve, key, x))
    return out


def flattening(results: list[common.ArmResult]) -> tuple[float, float]:
    """Dense's mean fixed-batch validation loss gained over the last third of the run, and over the whole."""
    drops, totals = [], []
    for r in (r for r in results if r.name == BASE and r.val_curve):
        end = r.val_curve[-1]["tokens"]
        drops.append(common.loss_at(r.val_curve, "tokens", 2 * end / 3) - r.val_curve[-1]["val_loss"])
        totals.append(r.val_curve[0]["val_loss"] - r.val_curve[-1]["val_loss"])
    return common.mean(drops), common.mean(totals)


def report(out: Path) -> list[Path]:
    """table.md and the plots, from results.json."""
    doc, results = common.load_results(out)
    first = doc["setting"]["seeds"][0]
    best = doc.get("best_n")
    char = [r for r in results if not r.name.endswith("(BPE)")]
    equal_time = min(r.val_curve[-1]["time"] for r in char if r.val_curve)  # the quickest run's end
    rows = []
    for name in common.arm_names(doc):
        mine = sorted((r for r in results if r.name == name), key=lambda r: r.seed)
        if not mine:
            continue
        test = common.paired_test(common.paired(results, name, BASE)) if name != BASE else None
        rows.append([name, mine[0].params_total, mine[0].params_active, common.per_seed(results, name),
                     "-" if test is None else test.interval, "baseline" if test is None else test.reading,
                     *("-" if name == BASE else common.paired_test(gains(results, name, f)).interval
                       for f in FRACTIONS),
                     "-" if name == BASE else common.paired_test(gains(results, name, 0, "time", equal_time)).interval,
                     common.mean(r.tokens_per_s for r in mine)])
    headers = ["arm", "params", "active", "full val loss per seed", f"minus {BASE} (mean [95% CI])", "reading",
               *(f"gain at {f:.0%} of tokens" for f in FRACTIONS), f"gain at {equal_time:.0f} s", "tokens/s"]
    table = common.markdown_table(headers, rows)
    drop, total = flattening(results)
    table += (f"\n\n{common.paired_note(first, BASE)} The 'gain at' columns are fixed-batch validation losses at that "
              f"share of the run (interpolated), paired the same way. Dense's curve: {total:.4f} nats gained over "
              f"the run, {drop:.4f} over its last third ({'flattened' if drop < FLAT else 'still falling'}: "
              f"the threshold is {FLAT} nats). 'gain at {equal_time:.0f} s' compares the arms at the same time in "
              "training steps, when the quickest run had finished.")
    bpe = [r for r in results if r.name.endswith("(BPE)")]
    if bpe:
        names = list(dict.fromkeys(r.name for r in bpe))
        moe = next(n for n in names if n != f"{BASE} (BPE)")
        test = common.paired_test(common.paired(results, moe, f"{BASE} (BPE)"))
        bpe_rows = [[n, common.per_seed(results, n), common.mean(r.full_val_loss for r in bpe if r.name == n)]
                    for n in names]
        table += ("\n\nBPE pair (byte-level BPE of 512 tokens; losses in nats per BPE token):\n\n"
                  + common.markdown_table(["arm", "full val loss per seed", "mean"], bpe_rows)
                  + f"\n\n{moe} minus {BASE} (BPE): {test.interval}, {test.reading}"
                  + (f" (N={best}: the lowest mean loss of the character arms)" if best else ""))
    return [common.write_table(out, table), common.plot_curves(char, out / "moe_capacity.png", TITLE),
            plot_gains(char, out, common.arm_names(doc))]


def plot_gains(results: list[common.ArmResult], out: Path, arms: list[str]) -> Path:
    """The paired gain over dense against tokens seen, one line per N (mean over seeds, the 95% interval
    shaded), and the final gain against N on a log axis."""
    fig, (by_tokens, by_n) = common.figure(2)
    names = [name for name in arms if name != BASE and any(r.name == name for r in results)]
    fractions = [i / 20 for i in range(2, 21)]
    for name in names:
        tests = [common.paired_test(gains(results, name, f)) for f in fractions]
        tokens = [f * max(r.val_curve[-1]["tokens"] for r in results if r.name == name) for f in fractions]
        colour = f"C{arms.index(name)}"  # the colours of the curves' plot
        line, = by_tokens.plot(tokens, [t.mean for t in tests], label=name, color=colour)
        if all(t.low == t.low for t in tests):  # intervals exist (3+ seeds)
            by_tokens.fill_between(tokens, [t.low for t in tests], [t.high for t in tests], alpha=0.2,
                                   color=line.get_color())
    by_tokens.axhline(0.0, color="black", linewidth=0.8)
    by_tokens.set(xlabel="training tokens", ylabel=f"validation loss minus {BASE} (nats)",
                  title="gain over dense by tokens (below 0: better)")
    by_tokens.legend(fontsize=8)
    ns = [int(name.split("=")[1]) for name in names]
    finals = [common.paired_test(gains(results, name, 1.0)) for name in names]
    by_n.errorbar(ns, [t.mean for t in finals], yerr=[[max(t.mean - t.low, 0) if t.low == t.low else 0 for t in finals],
                                                      [max(t.high - t.mean, 0) if t.high == t.high else 0
                                                       for t in finals]], marker="o", capsize=4)
    by_n.axhline(0.0, color="black", linewidth=0.8)
    by_n.set_xscale("log", base=2)
    by_n.set(xlabel="routed experts N (top-1 + shared)", ylabel=f"final validation loss minus {BASE}",
             title="gain over dense by N, end of run")
    return common.save_figure(fig, out / "moe_capacity_gain.png")
