"""Experiment 3, iRoPE and length: does attention keep working past the trained window?

Two models trained on windows of 128 characters: all layers RoPE, and iRoPE (every 4th layer without
positional embedding, the RoPE layers attending within chunks of 128). Both are then evaluated on
windows of 128 to 2,048 characters; the iRoPE model with and without the NoPE layers' attention
temperature (floor_scale = the training context: the scale is 1 inside it but for its last position,
1.07, and grows beyond).
Reported: the mean loss over the second half of each window, the positions furthest from training, and
paired readings (same seed, same batches) of iRoPE against all-RoPE and of the temperature on against off.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import load_run
from ..data import TokenDataset, default_cache_dir, find_corpus_files
from ..errors import DataError
from ..model import Transformer
from ..ops import build_model
from . import common
from .sweep import Sweep, setting_of

TITLE = "iRoPE: loss past the training context"
MULTIPLES = (1, 2, 4, 8, 16)  # evaluation lengths, in training contexts (the models are built for the last)
EVAL_TOKENS = 32_768  # per length: the same number of predicted tokens at every length


@torch.no_grad()
def far_half_loss(model: Transformer, tokens: torch.Tensor, length: int, budget: int) -> tuple[float, int]:
    """Mean next-token loss over positions [length/2, length) of non-overlapping windows of `length` (as many
    as `budget` tokens allow), and how many tokens it scored."""
    n = min(budget // length, (len(tokens) - 1) // length)
    if n < 1:
        raise DataError(f"the validation text ({len(tokens):,} tokens) is shorter than one window of {length + 1}; "
                        "use a larger corpus")
    total, count, half = 0.0, 0, length // 2
    for i in range(n):
        w = tokens[i * length:(i + 1) * length + 1]
        logits = model(w[None, :-1])
        total += F.cross_entropy(logits[0, half:].float(), w[1 + half:], reduction="sum").item()
        count += length - half
    return total / count, count


def with_temperature(model: Transformer, on: bool) -> Transformer:
    """The same weights with the NoPE layers' temperature tuning on or off (it has no parameters)."""
    other = build_model(model.cfg.replace(attn_temperature_tuning=on))
    other.load_state_dict(model.state_dict())
    return other.eval()


def run(out: Path, sweep: Sweep, results: list[common.ArmResult], progress: bool = True, tiny: bool = False
        ) -> list[Path]:
    """Evaluate every arm the sweep trained (`results`) at each length, then write results.json, table.md and
    the plot."""
    setting = setting_of(sweep, tiny)
    context = setting.seq_len
    lengths = [context * m for m in MULTIPLES]
    budget = EVAL_TOKENS if not setting.tiny else 4 * lengths[-1]
    curves: dict[str, list[list[float]]] = {}  # variant -> per seed, loss per length
    for r in results:
        model, tokenizer, _ = load_run(r.run_dir, prefer="last")
        data = TokenDataset.build(find_corpus_files(setting.data), tokenizer, default_cache_dir())
        val = torch.from_numpy(data.val_tokens.astype("int64"))
        variants = [(r.name, model.eval())] if r.name == "all RoPE" else \
            [("iRoPE, temperature on", with_temperature(model, True)),
             ("iRoPE, temperature off", with_temperature(model, False))]
        for name, m in variants:
            if progress:
                print(f"  evaluating {name} (seed {r.seed}) at {', '.join(map(str, lengths))}", flush=True)
            scored = [far_half_loss(m, val, n, budget) for n in lengths]
            curves.setdefault(name, []).append([loss for loss, _ in scored])
            counted = [count for _, count in scored]
    extra = {"lengths": lengths, "curves": curves, "scored_tokens": counted}
    return [common.save(out, "irope_length", setting, results, {**extra, "sweep": sweep.to_dict()}), *report(out)]


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    doc, results = common.load_results(out)
    lengths, curves, context = doc["lengths"], doc["curves"], doc["setting"]["seq_len"]
    tie, _ = common.largest_spread(results)
    rows = [[name, *[common.mean(c[i] for c in per) for i in range(len(lengths))],
             ", ".join(f"{c[-1] - c[0]:+.4f}" for c in per)
             + f"; {common.paired_test([c[-1] - c[0] for c in per]).interval}"]
            for name, per in curves.items()]
    # the seed-to-seed spread of the table's own quantity, at each length
    rows.append(["spread between seeds (largest of the three)",
                 *[max(max(c[i] for c in per) - min(c[i] for c in per) for per in curves.values())
                   for i in range(len(lengths))], "-"])
    on, off = curves.get("iRoPE, temperature on", []), curves.get("iRoPE, temperature off", [])
    rows.append(["temperature on minus off, per seed",
                 *[", ".join(f"{a[i] - b[i]:+.4f}" for a, b in zip(on, off, strict=True)) for i in range(len(lengths))],
                 "-"])
    scored = doc.get("scored_tokens") or ["?"] * len(lengths)
    table = common.markdown_table(["model", *[f"L={n}" for n in lengths],
                                   f"L={lengths[-1]} minus L={lengths[0]}, per seed; mean [95% CI]"], rows)
    table += (f"\n\nloss over the far half of each window (nats/char), mean over seeds "
              f"{', '.join(map(str, doc['setting']['seeds']))}; characters scored per length: "
              f"{', '.join(f'{n:,}' if isinstance(n, int) else n for n in scored)}; seed-to-seed spread of the "
              f"full validation loss at the training length: {common.format_spread(tie)}")
    # the curves of every variant list the seeds in the same order (both arms train on every seed)
    comparisons = [("iRoPE (temperature on) minus all RoPE", on, curves.get("all RoPE", [])),
                   ("temperature on minus off", on, off)]
    paired_rows = [[label, *[_cell([x[i] - y[i] for x, y in zip(a, b, strict=True)]) for i in range(len(lengths))]]
                   for label, a, b in comparisons if a and b]
    if paired_rows:
        full = common.paired_reading(results, "iRoPE", "all RoPE")
        table += ("\n\nPaired, seed by seed (mean difference [95% t-interval], reading):\n\n"
                  + common.markdown_table(["difference", *[f"L={n}" for n in lengths]], paired_rows)
                  + f"\n\nFull validation loss at the training length, iRoPE minus all RoPE: {full.interval}, "
                  f"{full.reading}. A tie is an interval within +-{common.EFFECT} nats; undecided, a wider one that "
                  "straddles 0.")
    fig, (ax,) = common.figure()
    for name, per in curves.items():
        ax.plot(lengths, [common.mean(c[i] for c in per) for i in range(len(lengths))], "o-", label=name)
    ax.axvline(context, color="grey", linestyle=":", label="training context")
    ax.set(xscale="log", xlabel="window length (characters)", ylabel="loss on the far half (nats/char)", title=TITLE)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    return [common.write_table(out, table), common.save_figure(fig, out / "irope_length.png")]


def _cell(diffs: list[float]) -> str:
    test = common.paired_test(diffs)
    return f"{test.interval} {test.reading}"
