"""Experiment 3, iRoPE and length: does attention keep working past the trained window, and is the longer
context *used*?

Two models per seed, trained on windows of 128 characters: all layers RoPE, and iRoPE (every 4th layer
without positional embedding, its temperature stepping every 128 positions). Chunked attention at the
training window changes nothing in training (no window crosses a chunk boundary: `tests/test_experiments.py`
checks the losses are equal), so chunking is read at evaluation: each model is evaluated with its RoPE
layers chunked at 128 and unchunked, and the iRoPE model with its temperature on and off. That gives the
four layouts the question needs apart (all-RoPE full or chunked, iRoPE unchunked or chunked), two of them
twice.

Measured on Shakespeare: the mean loss over the far half of windows of 128 to 2,048 characters, and the
loss at each position of the 2,048-character windows binned by how much context precedes it (a model that
uses more context predicts better with it). Then a use test: the same two layouts trained on passkey text
(`recall`: a digit after "#" asked for later after "?"), asked at distances up to 16x the training window.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import load_run
from ..data import TokenDataset, default_cache_dir, find_corpus_files
from ..errors import DataError
from ..model import Transformer
from ..ops import build_model
from . import common, recall
from .sweep import TINY_STEPS, Sweep, setting_of

TITLE = "iRoPE: loss and retrieval past the training context"
MULTIPLES = (1, 2, 4, 8, 16)  # evaluation lengths, in training contexts (the models are built for the last)
EVAL_TOKENS = 32_768  # per length: the same number of predicted tokens at every length
BINS = (0, 1, 2, 4, 8, 16)  # context bins of the longest windows, in training contexts: [1, 2) is 128-255
# (name, trained arm, RoPE layers chunked at the training window, NoPE temperature)
VARIANTS = (("all RoPE", "all RoPE", False, False), ("all RoPE, chunked", "all RoPE", True, False),
            ("iRoPE, unchunked", "iRoPE", False, True), ("iRoPE, unchunked, no temperature", "iRoPE", False, False),
            ("iRoPE, chunked", "iRoPE", True, True), ("iRoPE, chunked, no temperature", "iRoPE", True, False))
PASSKEY_STEPS, PASSKEY_LR, PASSKEY_MIN_LR = 3000, 2e-3, 2e-4  # the task is learnt by ~1,000 steps at this lr
PASSKEY_DISTANCES = (1 / 16, 1 / 4, 1 / 2, 15 / 16, 3 / 2, 3, 6, 12, 15.9)  # in training contexts
PASSKEY_PROBES = 96  # per distance and model


def variant(model: Transformer, chunk: int | None, temperature: bool) -> Transformer:
    """The same weights with the RoPE layers chunked at `chunk` (None: full attention) and the NoPE layers'
    temperature tuning on or off (neither has parameters)."""
    other = build_model(model.cfg.replace(attention_chunk_size=chunk, attn_temperature_tuning=temperature))
    other.load_state_dict(model.state_dict())
    return other.eval()


def layouts(model: Transformer, arm: str, context: int) -> Iterator[tuple[str, Transformer]]:
    """Each layout of VARIANTS that the model trained as `arm` gives, by name (chunks of `context`)."""
    for name, trained, chunked, temperature in VARIANTS:
        if trained == arm:
            yield name, variant(model, context if chunked else None, temperature)


@torch.no_grad()
def position_losses(model: Transformer, tokens: torch.Tensor, length: int, budget: int) -> tuple[torch.Tensor, int]:
    """The next-token loss at each position of non-overlapping windows of `length` (as many as `budget` tokens
    allow), summed over the windows; and how many windows."""
    n = min(max(budget // length, 1), (len(tokens) - 1) // length)
    if n < 1:
        raise DataError(f"the validation text ({len(tokens):,} tokens) is shorter than one window of {length + 1}; "
                        "use a larger corpus")
    total = torch.zeros(length, dtype=torch.float64)
    for i in range(n):
        w = tokens[i * length:(i + 1) * length + 1]
        total += F.cross_entropy(model(w[None, :-1])[0].float(), w[1:], reduction="none").double()
    return total, n


def far_half_loss(model: Transformer, tokens: torch.Tensor, length: int, budget: int) -> tuple[float, int]:
    """Mean next-token loss over positions [length/2, length) of windows of `length`; and the tokens scored."""
    total, n = position_losses(model, tokens, length, budget)
    half = length // 2
    return total[half:].sum().item() / (n * (length - half)), n * (length - half)


def run(out: Path, sweep: Sweep, results: list[common.ArmResult], progress: bool = True, tiny: bool = False
        ) -> list[Path]:
    """Evaluate the sweep's two models (`results`) in every layout at each length, train the passkey pair and
    ask it at each distance; then write results.json, table.md and the plot."""
    setting = setting_of(sweep, tiny)
    context = setting.seq_len
    lengths = [context * m for m in MULTIPLES]
    budget = EVAL_TOKENS if not setting.tiny else 4 * lengths[-1]
    curves: dict[str, list[list[float]]] = {}  # variant -> per seed, far-half loss per length
    by_context: dict[str, list[list[float]]] = {}  # variant -> per seed, loss per context bin at the longest
    counted: list[int] = []
    for r in sorted(results, key=lambda r: r.seed):
        model, tokenizer, _ = load_run(r.run_dir, prefer="last")
        data = TokenDataset.build(find_corpus_files(setting.data), tokenizer, default_cache_dir())
        val = torch.from_numpy(data.val_tokens.astype("int64"))
        for name, m in layouts(model, r.name, context):
            if progress:
                print(f"  evaluating {name} (seed {r.seed}) at {', '.join(map(str, lengths))}", flush=True)
            scored = [far_half_loss(m, val, n, budget) for n in lengths[:-1]]
            total, windows = position_losses(m, val, lengths[-1], budget)
            half = lengths[-1] // 2
            far = windows * (lengths[-1] - half)
            scored.append((total[half:].sum().item() / far, far))
            curves.setdefault(name, []).append([loss for loss, _ in scored])
            by_context.setdefault(name, []).append(
                [total[a * context:b * context].mean().item() / windows for a, b in zip(BINS, BINS[1:], strict=False)])
            counted = [count for _, count in scored]
    passkey = passkey_test(out, sweep, setting, progress, tiny)
    runs = passkey.pop("runs")
    extra = {"lengths": lengths, "curves": curves, "by_context": by_context, "bins": list(BINS),
             "scored_tokens": counted, **passkey}
    return [common.save(out, "irope_length", setting, [*results, *runs],
                        {**extra, "sweep": sweep.to_dict()}), *report(out)]


def passkey_test(out: Path, sweep: Sweep, setting: common.Setting, progress: bool, tiny: bool) -> dict:
    """Train each arm on passkey text (`recall.write_corpus`, questions at most the training window after their
    passkey) seed by seed, then ask every layout at each distance: in windows of the training length, and in
    windows of 16x it. Returns the runs and the accuracies (variant -> per seed, per distance)."""
    context, steps = setting.seq_len, (TINY_STEPS if tiny else PASSKEY_STEPS)
    corpus = recall.write_corpus(out / "passkey" / "text.txt",
                                 int(1.25 * steps * setting.batch_size * context) + 64 * context, reach=context)
    far = sorted({max(2, min(round(f * context), 16 * context - 1)) for f in PASSKEY_DISTANCES})
    near = [d for d in far if d < context]
    probes = 8 if tiny else PASSKEY_PROBES
    runs, near_acc, far_acc = [], {}, {}
    for seed in sweep.seeds:
        for arm in sweep.arms:
            cfg, tc = sweep.configs(arm, tiny)
            tc = tc.replace(seed=seed, max_steps=steps, lr=PASSKEY_LR, min_lr=PASSKEY_MIN_LR,
                            warmup_steps=min(tc.warmup_steps, steps))
            r = common.train_run(f"{arm.name} (passkey)", cfg, tc, out, progress, str(corpus), sweep.score_tokens)
            runs.append(r)
            model, tokenizer, _ = load_run(r.run_dir, prefer="last")
            for name, m in layouts(model, arm.name, context):
                if progress:
                    print(f"  asking {name} (seed {seed}) at distances {', '.join(map(str, far))}", flush=True)
                near_acc.setdefault(name, []).append(recall.accuracy(m, tokenizer, context, near, probes, seed=1))
                far_acc.setdefault(name, []).append(recall.accuracy(m, tokenizer, 16 * context, far, probes, seed=2))
    return {"runs": runs, "passkey": {"steps": steps, "probes": probes, "near": near, "far": far,
                                      "near_accuracy": near_acc, "far_accuracy": far_acc}}


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    doc, results = common.load_results(out)
    lengths, curves, context = doc["lengths"], doc["curves"], doc["setting"]["seq_len"]
    shakespeare = [r for r in results if not r.name.endswith("(passkey)")]
    tie, _ = common.largest_spread(shakespeare)
    L = [f"L={n}" for n in lengths]
    rows = [[name, *[common.mean(c[i] for c in per) for i in range(len(lengths))],
             ", ".join(f"{c[-1] - c[0]:+.4f}" for c in per)
             + f"; {common.paired_test([c[-1] - c[0] for c in per]).interval}"] for name, per in curves.items()]
    rows.append(["spread between seeds (largest of the variants)",
                 *[max(max(c[i] for c in per) - min(c[i] for c in per) for per in curves.values())
                   for i in range(len(lengths))], "-"])
    scored = doc.get("scored_tokens") or ["?"] * len(lengths)
    table = "### Loss past the training context (Shakespeare)\n\n" + common.markdown_table(
        ["layout", *L, f"L={lengths[-1]} minus L={lengths[0]}, per seed; mean [95% CI]"], rows)
    table += (f"\n\nloss over the far half of each window (nats/char), mean over seeds "
              f"{', '.join(map(str, doc['setting']['seeds']))}; characters scored per length: "
              f"{', '.join(f'{n:,}' if isinstance(n, int) else n for n in scored)}; seed-to-seed spread of the "
              f"full validation loss at the training length: {common.format_spread(tie)}")
    comparisons = [("iRoPE, chunked", "all RoPE"), ("iRoPE, chunked", "all RoPE, chunked"),
                   ("iRoPE, unchunked", "all RoPE"), ("all RoPE, chunked", "all RoPE"),
                   ("iRoPE, chunked", "iRoPE, unchunked"), ("iRoPE, chunked", "iRoPE, chunked, no temperature"),
                   ("iRoPE, unchunked", "iRoPE, unchunked, no temperature")]
    paired_rows = [[f"{a} minus {b}", *[_cell([x[i] - y[i] for x, y in zip(curves[a], curves[b], strict=True)])
                                         for i in range(len(lengths))]]
                   for a, b in comparisons if a in curves and b in curves]
    if paired_rows:
        full = common.paired_reading(shakespeare, "iRoPE", "all RoPE")
        table += ("\n\nPaired, seed by seed (mean difference [95% t-interval], reading):\n\n"
                  + common.markdown_table(["difference", *L], paired_rows)
                  + f"\n\nFull validation loss at the training length, iRoPE minus all RoPE: {full.interval}, "
                  f"{full.reading}. A tie is an interval within +-{common.EFFECT} nats; undecided, a wider one that "
                  "straddles 0.")
    bins = doc.get("bins", list(BINS))
    edges = [f"{a * context}-{b * context - 1}" for a, b in zip(bins, bins[1:], strict=False)]
    by_context = doc.get("by_context", {})
    if by_context:
        table += ("\n\n### Loss by the context before a position (windows of "
                  f"{lengths[-1]:,})\n\n" + common.markdown_table(
                      ["layout", *[f"positions {e}" for e in edges]],
                      [[name, *[common.mean(c[i] for c in per) for i in range(len(edges))]]
                       for name, per in by_context.items()])
                  + "\n\nmean loss (nats/char) at the positions of each range, mean over seeds: a layout that "
                  "uses more context is lower further right")
    pk = doc.get("passkey")
    if pk:
        pct = lambda v: f"{100 * v:.0f}%"  # noqa: E731
        near = [[name, *[pct(common.mean(c[i] for c in per)) for i in range(len(pk["near"]))]]
                for name, per in pk["near_accuracy"].items()]
        far = [[name, *[pct(common.mean(c[i] for c in per)) for i in range(len(pk["far"]))],
                " / ".join(", ".join(pct(c[i]) for c in per) for i in range(len(pk["far"])) if pk["far"][i] >= context)]
               for name, per in pk["far_accuracy"].items()]
        table += (f"\n\n### Passkey retrieval (trained {pk['steps']:,} steps on windows of {context}; "
                  f"{pk['probes']} probes per distance; chance 10%)\n\nIn windows of the training length "
                  f"({context}):\n\n" + common.markdown_table(["layout", *[f"d={d}" for d in pk["near"]]], near)
                  + f"\n\nIn windows of {16 * context:,}, the question at the end:\n\n"
                  + common.markdown_table(["layout", *[f"d={d}" for d in pk["far"]],
                                           f"per seed, d >= {context}"], far)
                  + "\n\naccuracy: the share of probes whose passkey digit is the model's most likely next "
                  "character, mean over seeds")
    fig, axes = common.figure(ncols=3 if pk else 2, height=4.5)
    for name, per in curves.items():
        axes[0].plot(lengths, [common.mean(c[i] for c in per) for i in range(len(lengths))], "o", label=name,
                     linestyle=_style(name))
    axes[0].axvline(context, color="grey", linestyle=":", label="training context")
    axes[0].set(xscale="log", xlabel="window length (characters)", ylabel="loss on the far half (nats/char)",
                title="Shakespeare: loss by window length")
    axes[0].set_xticks(lengths, [str(n) for n in lengths])
    axes[0].minorticks_off()
    axes[0].legend(fontsize=7)
    middles = [max(1, (a + b) / 2 * context) for a, b in zip(bins, bins[1:], strict=False)]
    for name, per in by_context.items():
        axes[1].plot(middles, [common.mean(c[i] for c in per) for i in range(len(edges))], "o", label=name,
                     linestyle=_style(name))
    axes[1].axvline(context, color="grey", linestyle=":")
    axes[1].set(xscale="log", xlabel=f"context before the position (characters, windows of {lengths[-1]:,})",
                ylabel="loss (nats/char)", title="Shakespeare: loss by context")
    if pk:
        for name, per in pk["far_accuracy"].items():
            axes[2].plot(pk["far"], [100 * common.mean(c[i] for c in per) for i in range(len(pk["far"]))], "o",
                         label=name, linestyle=_style(name))
        axes[2].axvline(context, color="grey", linestyle=":")
        axes[2].axhline(10, color="grey", linestyle="--", linewidth=0.8, label="chance")
        axes[2].set(xscale="log", xlabel="passkey distance d (characters)", ylabel="accuracy (%)",
                    title=f"Passkey in windows of {16 * context:,}")
        axes[2].legend(fontsize=7)
    return [common.write_table(out, table), common.save_figure(fig, out / "irope_length.png")]


def _style(name: str) -> str:
    """Dashed for a layout with the temperature off: it often lies on its twin, which stays visible."""
    return "--" if "no temperature" in name else "-"


def _cell(diffs: list[float]) -> str:
    test = common.paired_test(diffs)
    return f"{test.interval} {test.reading}"
