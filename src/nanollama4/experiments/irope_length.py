"""Experiment 3, iRoPE and length: does the NoPE layer use context that the RoPE layers cannot see?

Three models per seed, trained on windows of T characters with the RoPE layers chunked at C < T where they
are chunked (the sweep file: T = 128, C = 32, four chunks a window as in the demo's 64 in 256): all RoPE
with full attention; all RoPE chunked ("chunked RoPE": no layer sees past its chunk, by construction); and
iRoPE (R-R-R-N, Llama 4's pattern: the 4th layer without positional embedding and with full attention, its
temperature stepping every C positions, Llama 4's floor being its chunk). Inside one training window,
context between C and T back is reachable by iRoPE only through its NoPE layer, so training itself asks
that layer to reach past the chunk. The iRoPE model is also read with its temperature off.

Measured, on Shakespeare: the loss over the far half of windows of T to 16T, and the loss at each position
of windows of 16T binned by the context before it (0 to C, C to T, T to 2T, ...). On passkey text (`recall`:
the same three arms trained again, questions at most T after their passkey): accuracy at distances in three
bands, inside a chunk (d < C), past the chunk inside the window (C <= d < T) and past the window (T <= d <
16T), in windows of T, 4T and 16T (the passkey at different depths). And the mechanism: each layer's
attention, at the question, on the passkey's two characters, by distance; and the iRoPE model asked again
with its NoPE layer blind to the passkey (masked out of that layer's keys): if retrieval past the chunk
goes through that layer, it falls to chance there and nowhere else.

table.md opens with the findings, each with its paired interval and the word that interval allows (`findings`).
`--tiny` keeps the design at a small size (the sweep file's `tiny`: chunks of 8 in windows of 32).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from ..base.errors import DataError
from ..interop.checkpoint import load_run
from ..model.attention import attention_mask
from ..model.tokenizer import CharTokenizer
from ..model.transformer import Transformer
from ..ops import build_model
from ..training.corpus import find_corpus_files
from ..training.data import TokenDataset, default_cache_dir
from . import common, recall
from .sweep import TINY_STEPS, Sweep, setting_of

TITLE = "iRoPE: does the NoPE layer reach past the chunk and the training window?"
MULTIPLES = (1, 2, 4, 8, 16)  # evaluation lengths, in training contexts (the models are built for the last)
EVAL_TOKENS = 32_768  # per length: the same number of predicted tokens at every length
ROWS_TOKENS = 8192  # tokens per evaluation batch
# (layout, trained arm, NoPE temperature, NoPE layer blind to the passkey: passkey probes only)
VARIANTS = (("all RoPE", "all RoPE", False, False), ("chunked RoPE", "chunked RoPE", False, False),
            ("iRoPE", "iRoPE", True, False), ("iRoPE, no temperature", "iRoPE", False, False),
            ("iRoPE, NoPE layer blind to the passkey", "iRoPE", True, True))
# Fewer steps leave every arm at chance even inside a chunk (1,500 of 16 windows, 3,000 of 8; all RoPE's attention
# is on the passkey by then, its answer not yet). Filler of repeated sentences instead of random letters was
# worse: 3,000 steps of 16 at chance, attention off the passkey (the filler is learnt; the passkey never is).
PASSKEY_STEPS, PASSKEY_BATCH, PASSKEY_LR, PASSKEY_MIN_LR = 3000, 16, 2e-3, 2e-4
PASSKEY_WINDOWS = (1, 4, 16)  # probe windows, in training contexts: one distance at several depths
PASSKEY_PROBES = 24  # per distance, window and model
BANDS = ("d < C", "C <= d < T", "T <= d < 16T")
ACCURACY_EFFECT = 5.0  # percentage points: a smaller paired difference in accuracy is a tie


def bins(context: int, chunk: int) -> list[int]:
    """Edges of the context bins of the longest windows, in characters: 0, C, T, 2T, 4T, 8T, 16T."""
    return sorted({0, min(chunk, context), *(context * m for m in MULTIPLES)})


def distances(context: int, chunk: int) -> list[int]:
    """Passkey distances: three inside a chunk, three past it inside the window, five past the window."""
    c = min(chunk, context)
    near = [c // 8, c // 2, c - 2]
    mid = [round(c + f * (context - c)) for f in (0.1, 0.45, 0.95)] if c < context else []
    far = [round(context * f) for f in (1.25, 2.5, 5, 10, 15.9)]
    return sorted({d for d in (*near, *mid, *far) if 2 <= d <= 16 * context - 2})


def band(d: int, context: int, chunk: int) -> int:
    return 0 if d < chunk else 1 if d < context else 2


def variant(model: Transformer, temperature: bool) -> Transformer:
    """The same weights with the NoPE layers' temperature on or off (it has no parameters)."""
    if model.cfg.attn_temperature_tuning == temperature or not model.cfg.nope_interval:
        return model.eval()
    other = build_model(model.cfg.replace(attn_temperature_tuning=temperature))
    other.load_state_dict(model.state_dict())
    return other.eval()


def layouts(model: Transformer, arm: str, probes: bool = False) -> Iterator[tuple[str, Transformer, bool]]:
    """Each layout of VARIANTS that the model trained as `arm` gives: (name, model, NoPE layer blind)."""
    for name, trained, temperature, blind in VARIANTS:
        if trained == arm and (probes or not blind):
            yield name, variant(model, temperature), blind


@torch.no_grad()
def position_losses(model: Transformer, tokens: torch.Tensor, length: int, budget: int) -> tuple[torch.Tensor, int]:
    """The next-token loss at each position of non-overlapping windows of `length` (as many as `budget` tokens
    allow), summed over the windows; and how many windows."""
    n = min(max(budget // length, 1), (len(tokens) - 1) // length)
    if n < 1:
        raise DataError(f"the validation text ({len(tokens):,} tokens) is shorter than one window of {length + 1}; "
                        "use a larger corpus")
    windows = tokens[:n * length + 1].unfold(0, length + 1, length)  # (n, length + 1), overlapping by one
    total = torch.zeros(length, dtype=torch.float64)
    rows = max(1, ROWS_TOKENS // length)
    for i in range(0, n, rows):
        w = windows[i:i + rows]
        logits = model(w[:, :-1]).float()
        total += F.cross_entropy(logits.transpose(1, 2), w[:, 1:], reduction="none").double().sum(0)
    return total, n


@contextmanager
def watched(model: Transformer, at: int, blind: bool) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block: each layer's attention probabilities at the last position on positions `at` and
    `at` + 1 (a passkey's "#" and digit), summed, per row and head: layer -> (B, H). `blind`: the NoPE
    layers may not attend to those two positions at all (every query; they are masked out)."""
    seen: dict[int, torch.Tensor] = {}
    saved = []
    for i, block in enumerate(model.blocks):
        attn, original = block.attn, block.attn.attend
        saved.append((attn, original))

        def attend(q, k, v, q_pos, k_pos, chunk, mask, i=i, original=original, nope=not attn.use_rope):
            if blind and nope:
                mask = attention_mask(q_pos, k_pos, chunk).clone()
                mask[..., at:at + 2] = False
            out = original(q, k, v, q_pos, k_pos, chunk, mask)
            last = q[:, -1].float()  # (B, H, Dh): what the question attended with (temperature applied)
            keys = k.float().repeat_interleave(q.shape[2] // k.shape[2], dim=2)  # (B, Tk, H, Dh)
            scores = torch.einsum("bhd,bthd->bht", last, keys) / math.sqrt(q.shape[-1])
            allowed = (attention_mask(q_pos[-1:], k_pos, chunk) if mask is None else mask[..., -1:, :])
            probs = scores.masked_fill(~allowed.reshape(1, 1, -1), -math.inf).softmax(-1)
            seen[i] = probs[..., at:at + 2].sum(-1)
            return out

        attn.attend = attend
    try:
        yield seen
    finally:
        for attn, original in saved:
            attn.attend = original


@torch.no_grad()
def ask(model: Transformer, tokenizer: CharTokenizer, length: int, d: int, n: int, blind: bool = False,
        seed: int = 0, batch: int = 8) -> tuple[float, list[list[float]]]:
    """`n` passkey probes of `length` characters at distance `d` (the same probes for every model): the share
    answered right, and each layer's attention at the question on the passkey, per head (mean over probes)."""
    rng = random.Random(f"{seed}-{length}-{d}")
    texts = [recall.probe(rng, length, d) for _ in range(n)]
    right, weight = 0, torch.zeros(len(model.blocks), model.cfg.n_heads, dtype=torch.float64)
    for i in range(0, n, batch):
        part = texts[i:i + batch]
        ids = torch.tensor([tokenizer.encode(t) for t, _ in part])
        with watched(model, length - 1 - d, blind) as seen:
            guess = model(ids, last_only=True)[:, -1].argmax(-1).tolist()
        right += sum(tokenizer.decode([g]) == a for g, (_, a) in zip(guess, part, strict=True))
        weight += torch.stack([seen[j].sum(0) for j in range(len(model.blocks))]).double()
    return right / n, (weight / n).tolist()


def run(out: Path, sweep: Sweep, results: list[common.ArmResult], progress: bool = True, tiny: bool = False
        ) -> list[Path]:
    """Evaluate the sweep's three models (`results`) in every layout at each length, train the passkey trio
    and ask it at each distance and depth; then write results.json, table.md and the plot."""
    setting = setting_of(sweep, tiny)
    context = setting.seq_len
    chunk = min(sweep.configs(next(a for a in sweep.arms if a.name == "iRoPE"), tiny)[0].attention_chunk_size
                or context, context)
    lengths = [context * m for m in MULTIPLES]
    edges = bins(context, chunk)
    budget = EVAL_TOKENS if not setting.tiny else 4 * lengths[-1]
    curves: dict[str, list[list[float]]] = {}  # layout -> per seed, far-half loss per length
    by_context: dict[str, list[list[float]]] = {}  # layout -> per seed, loss per context bin at the longest
    counted: list[int] = []
    for r in sorted(results, key=lambda r: r.seed):
        model, tokenizer, _ = load_run(r.run_dir, prefer="last")
        data = TokenDataset.build(find_corpus_files(setting.data), tokenizer, default_cache_dir())
        val = torch.from_numpy(data.val_tokens.astype("int64"))
        for name, m, _ in layouts(model, r.name):
            if progress:
                print(f"  evaluating {name} (seed {r.seed}) at {', '.join(map(str, lengths))}", flush=True)
            far, counted = [], []
            for n in lengths:
                total, windows = position_losses(m, val, n, budget)
                far.append(total[n // 2:].sum().item() / (windows * (n - n // 2)))
                counted.append(windows * (n - n // 2))
            curves.setdefault(name, []).append(far)
            by_context.setdefault(name, []).append([total[a:b].mean().item() / windows
                                                    for a, b in zip(edges, edges[1:], strict=False)])
    passkey = passkey_test(out, sweep, setting, chunk, progress, tiny)
    runs = passkey.pop("runs")
    extra = {"lengths": lengths, "chunk": chunk, "curves": curves, "by_context": by_context, "bins": edges,
             "scored_tokens": counted, **passkey}
    return [common.save(out, "irope_length", setting, [*results, *runs],
                        {**extra, "sweep": sweep.to_dict()}), *report(out)]


def passkey_test(out: Path, sweep: Sweep, setting: common.Setting, chunk: int, progress: bool, tiny: bool) -> dict:
    """Train each arm on passkey text (questions at most the training window after their passkey) seed by
    seed, then ask every layout at each distance in windows of 1, 4 and 16 training contexts. Returns the
    runs, and per layout and seed: accuracy and each layer's attention on the passkey, per window and
    distance."""
    context, steps = setting.seq_len, (TINY_STEPS if tiny else PASSKEY_STEPS)
    batch = setting.batch_size if tiny else PASSKEY_BATCH
    corpus = recall.write_corpus(out / "passkey" / "text.txt",
                                 int(1.25 * steps * batch * context) + 64 * context, reach=context)
    asked = distances(context, chunk)[::2] if tiny else distances(context, chunk)  # tiny: each path, not each d
    probes = 4 if tiny else PASSKEY_PROBES
    windows = PASSKEY_WINDOWS[::2] if tiny else PASSKEY_WINDOWS  # tiny: two depths are enough to run each path
    runs, accuracy, attention = [], {}, {}
    for seed in sweep.seeds:
        for arm in sweep.arms:
            cfg, tc = sweep.configs(arm, tiny)
            tc = tc.replace(seed=seed, max_steps=steps, batch_size=batch, lr=PASSKEY_LR, min_lr=PASSKEY_MIN_LR,
                            warmup_steps=min(tc.warmup_steps, steps))
            r = common.train_run(f"{arm.name} (passkey)", cfg, tc, out, progress, str(corpus), sweep.score_tokens)
            runs.append(r)
            model, tokenizer, _ = load_run(r.run_dir, prefer="last")
            for name, m, blind in layouts(model, arm.name, probes=True):
                if progress:
                    print(f"  asking {name} (seed {seed}) at distances {', '.join(map(str, asked))}", flush=True)
                acc, att = {}, {}
                for w in windows:
                    length = w * context
                    got = [ask(m, tokenizer, length, d, probes, blind) for d in asked if d <= length - 2]
                    acc[str(w)], att[str(w)] = [a for a, _ in got], [weights for _, weights in got]
                accuracy.setdefault(name, []).append(acc)
                attention.setdefault(name, []).append(att)
    return {"runs": runs, "passkey": {"steps": steps, "batch_size": batch, "probes": probes, "distances": asked,
                                      "windows": list(windows), "accuracy": accuracy,
                                      "attention": attention}}


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    doc, results = common.load_results(out)
    lengths, curves, context, chunk = doc["lengths"], doc["curves"], doc["setting"]["seq_len"], doc["chunk"]
    shakespeare = [r for r in results if not r.name.endswith("(passkey)")]
    tie, _ = common.largest_spread(shakespeare)
    L = [f"L={n}" for n in lengths]
    rows = [[name, *[common.mean(c[i] for c in per) for i in range(len(lengths))],
             ", ".join(f"{c[-1] - c[0]:+.4f}" for c in per)
             + f"; {common.paired_test([c[-1] - c[0] for c in per]).interval}"] for name, per in curves.items()]
    rows.append(["spread between seeds (largest of the layouts)",
                 *[max(max(c[i] for c in per) - min(c[i] for c in per) for per in curves.values())
                   for i in range(len(lengths))], "-"])
    table = (f"Trained on windows of T = {context} characters; RoPE layers chunked at C = {chunk} where chunked.\n\n"
             + _tiny_note(doc) + findings(doc)
             + "\n\n### Loss past the training context (Shakespeare)\n\n" + common.markdown_table(
                 ["layout", *L, f"L={lengths[-1]} minus L={lengths[0]}, per seed; mean [95% CI]"], rows))
    table += (f"\n\nloss over the far half of each window (nats/char), mean over seeds "
              f"{', '.join(map(str, doc['setting']['seeds']))}; characters scored per length: "
              f"{', '.join(f'{n:,}' for n in doc['scored_tokens'])}; seed-to-seed spread of the full validation "
              f"loss at the training length: {common.format_spread(tie)}")
    comparisons = [("iRoPE", "chunked RoPE"), ("iRoPE", "all RoPE"), ("chunked RoPE", "all RoPE"),
                   ("iRoPE", "iRoPE, no temperature")]
    pairs = [(a, b) for a, b in comparisons if a in curves and b in curves]
    paired_rows = [[f"{a} minus {b}", *[_cell([x[i] - y[i] for x, y in zip(curves[a], curves[b], strict=True)])
                                        for i in range(len(lengths))]] for a, b in pairs]
    table += ("\n\nPaired, seed by seed (mean difference [95% t-interval], reading):\n\n"
              + common.markdown_table(["difference", *L], paired_rows))
    edges, by_context = doc["bins"], doc["by_context"]
    spans = [f"{a}-{b - 1}" for a, b in zip(edges, edges[1:], strict=False)]
    table += (f"\n\n### Loss by the context before a position (windows of {lengths[-1]:,})\n\n"
              + common.markdown_table(["layout", *[f"positions {s}" for s in spans]],
                                      [[name, *[common.mean(c[i] for c in per) for i in range(len(spans))]]
                                       for name, per in by_context.items()])
              + "\n\nmean loss (nats/char) at the positions of each range, mean over seeds. The levels differ with "
              "the text at those positions; the paired differences below do not:\n\n"
              + common.markdown_table(["difference", *[f"positions {s}" for s in spans]],
                                      [[f"{a} minus {b}", *[_cell([x[i] - y[i] for x, y in zip(
                                          by_context[a], by_context[b], strict=True)]) for i in range(len(spans))]]
                                       for a, b in pairs]))
    pk = doc.get("passkey")
    if pk:
        table += _passkey_tables(pk, context, chunk)
    common.write_table(out, table)
    return [out / "table.md", _plot(out, doc, context, chunk)]


def _tiny_note(doc: dict) -> str:
    """What the smoke-test scale changed (nothing at full scale): the same design, smaller, too short to mean."""
    if not doc["setting"].get("tiny"):
        return ""
    context, chunk, pk = doc["setting"]["seq_len"], doc["chunk"], doc.get("passkey") or {}
    return (f"--tiny: this design at a small size, windows of T = {context} with chunks of C = {chunk} "
            f"({context / chunk:g} a window), {doc['setting']['steps']} steps an arm"
            + (f", the passkey asked at every other distance ({', '.join(map(str, pk['distances']))}) in windows "
               f"of {_listed([f'{w}T' for w in pk['windows']])} with {pk['probes']} probes" if pk else "")
            + ": every path runs, the numbers mean nothing.\n\n")


def findings(doc: dict) -> str:
    """The findings line: each question of the experiment with the paired interval it rests on and the word
    that interval allows, made by the tables' own cells (`_points`, `_cell`: a direction only where the
    interval excludes 0, "undecided" where it straddles 0 widely), so that it cannot call decided what its
    table leaves undecided."""
    context, chunk, curves, pk = doc["setting"]["seq_len"], doc["chunk"], doc["curves"], doc.get("passkey")
    lines = []
    if pk:
        names, first, last = pk["accuracy"], pk["windows"][0], pk["windows"][-1]
        base, blind = "chunked RoPE", "iRoPE, NoPE layer blind to the passkey"
        for what, b, w, k in ((f"retrieval past the chunk inside the window ({BANDS[1]}, windows of {first}T)",
                                base, first, 1), ("the same through the NoPE layer", blind, first, 1),
                               (f"retrieval past the window ({BANDS[2]}, windows of {last}T)", base, last, 2)):
            if "iRoPE" in names and b in names:
                x, y = _band_means(pk, "iRoPE", w, context, chunk), _band_means(pk, b, w, context, chunk)
                cell = _points([s[k] - t[k] for s, t in zip(x, y, strict=True)])
                lines.append(f"- {what}: iRoPE minus {b}, in accuracy points, "
                             + ("not measured (no distance in that band)" if cell == "-" else cell))
    for b in ("chunked RoPE", "iRoPE, no temperature"):
        if "iRoPE" in curves and b in curves:
            lines.append(f"- loss on Shakespeare at L={doc['lengths'][-1]}: iRoPE minus {b}, in nats/char, " + _cell(
                [x[-1] - y[-1] for x, y in zip(curves["iRoPE"], curves[b], strict=True)]))
    return ("Findings, each with the paired interval below that it rests on (mean [95% t-interval] over seeds "
            f"{', '.join(map(str, doc['setting']['seeds']))}) and the reading that interval allows:\n\n"
            + "\n".join(lines))


def _band_means(pk: dict, name: str, w: int, context: int, chunk: int) -> list[list[float]]:
    """Per seed, the accuracy (%) in each band of windows of w contexts (nan where the band has no distance)."""
    ds = [d for d in pk["distances"] if d <= w * context - 2]
    return [[100 * common.mean(a for d, a in zip(ds, acc[str(w)], strict=True) if band(d, context, chunk) == b)
             for b in range(len(BANDS))] for acc in pk["accuracy"][name]]


def _passkey_tables(pk: dict, context: int, chunk: int) -> str:
    windows, names = pk["windows"], list(pk["accuracy"])
    columns = [(w, b) for w in windows for b in range(len(BANDS)) if any(
        band(d, context, chunk) == b and d <= w * context - 2 for d in pk["distances"])]
    head = [f"{w}T: {BANDS[b]}" for w, b in columns]
    text = (f"\n\n### Passkey retrieval (trained {pk['steps']:,} steps of {pk.get('batch_size', '?')} windows of "
            f"T = {context}; {pk['probes']} "
            f"probes per distance and window; chance 10%)\n\nBy band, the question at the end of windows of "
            f"{_listed([str(w) for w in windows])} T (the passkey at different depths); accuracy (%), mean over seeds "
            "and the band's distances:\n\n"
            + common.markdown_table(["layout", *head], [
                [name, *[f"{common.mean(s[b] for s in _band_means(pk, name, w, context, chunk)):.0f}"
                         for w, b in columns]] for name in names]))
    big = windows[-1]
    ds = [d for d in pk["distances"] if d <= big * context - 2]
    text += (f"\n\nBy distance, in windows of {big * context:,} (per seed: each band's mean):\n\n"
             + common.markdown_table(
        ["layout", *[f"d={d}" for d in ds], "per seed, by band"],
        [[name, *[f"{100 * common.mean(acc[str(big)][i] for acc in per):.0f}" for i in range(len(ds))],
          " / ".join(", ".join(f"{s[b]:.0f}" for s in _band_means(pk, name, big, context, chunk))
                     for b in range(len(BANDS)))] for name, per in pk["accuracy"].items()]))
    pairs = [(a, b) for a, b in (("iRoPE", "chunked RoPE"), ("iRoPE", "all RoPE"), ("iRoPE", "iRoPE, no temperature"),
                                 ("iRoPE", "iRoPE, NoPE layer blind to the passkey")) if a in names and b in names]
    rows = []
    for a, b in pairs:
        cells = []
        for w, k in columns:
            x, y = _band_means(pk, a, w, context, chunk), _band_means(pk, b, w, context, chunk)
            cells.append(_points([s[k] - t[k] for s, t in zip(x, y, strict=True)]))
        rows.append([f"{a} minus {b}", *cells])
    text += ("\n\nPaired, seed by seed (accuracy difference in points, mean [95% t-interval]; a tie within "
             f"+-{ACCURACY_EFFECT:g}):\n\n" + common.markdown_table(["difference", *head], rows))
    att = pk["attention"]
    layer_rows = []
    for name in [v[0] for v in VARIANTS if v[0] in att]:
        n_layers = len(att[name][0][str(big)][0])
        for j in range(n_layers):
            layer_rows.append([f"{name}: layer {j}", *[f"{_look(att[name], big, i, j, 'mean'):.4f} "
                                                      f"({_look(att[name], big, i, j, 'top'):.3f})"
                                                      for i in range(len(ds))]])
    layer_rows.append(["uniform over the visible keys (2 / position)", *[f"{2 / (big * context):.4f}"] * len(ds)])
    text += (f"\n\nThe mechanism: each layer's attention at the question on the passkey's two characters (the head "
             f"that looks most, mean over probes and seeds), windows of {big * context:,}:\n\n"
             + common.markdown_table(["layer", *[f"d={d}" for d in ds]], layer_rows))
    return text


def _listed(items: list[str]) -> str:  # 'a', 'a and b', 'a, b and c'
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _plot(out: Path, doc: dict, context: int, chunk: int) -> Path:
    lengths, curves, edges, pk = doc["lengths"], doc["curves"], doc["bins"], doc.get("passkey")
    fig, axes = common.figure(ncols=4 if pk else 2, width=4.6, height=4.2)
    for name, per in curves.items():
        axes[0].plot(lengths, [common.mean(c[i] for c in per) for i in range(len(lengths))], "o", label=name,
                     **_style(name))
    axes[0].set(xscale="log", xlabel="window length (characters)", ylabel="loss on the far half (nats/char)",
                title="Shakespeare: loss by window length")
    axes[0].set_xticks(lengths, [str(n) for n in lengths])
    axes[0].minorticks_off()
    middles = [max(1, (a + b) / 2) for a, b in zip(edges, edges[1:], strict=False)]
    base = doc["by_context"].get("chunked RoPE")
    for name, per in doc["by_context"].items():
        ys = [common.mean(c[i] for c in per) - (common.mean(c[i] for c in base) if base else 0)
              for i in range(len(middles))]
        axes[1].plot(middles, ys, "o", label=name, **_style(name))
    axes[1].set(xscale="log", xlabel=f"context before the position (windows of {lengths[-1]:,})",
                ylabel="loss minus chunked RoPE's (nats/char)" if base else "loss (nats/char)",
                title="Shakespeare: loss by context")
    if pk:
        big = pk["windows"][-1]
        ds = [d for d in pk["distances"] if d <= big * context - 2]
        for name, per in pk["accuracy"].items():
            axes[2].plot(ds, [100 * common.mean(a[str(big)][i] for a in per) for i in range(len(ds))], "o",
                         label=name, **_style(name))
        axes[2].axhline(10, color="grey", linestyle="--", linewidth=0.8, label="chance")
        axes[2].set(xscale="log", xlabel="passkey distance d (characters)", ylabel="accuracy (%)",
                    title=f"Passkey in windows of {big * context:,}")
        for name, per in pk["attention"].items():
            if "iRoPE" not in name or "blind" in name:  # the blinded layout's NoPE layer gives it 0, off the scale
                continue
            last = len(per[0][str(big)][0]) - 1  # the NoPE layer: the last of R-R-R-N
            axes[3].plot(ds, [_look(per, big, i, last, "mean") for i in range(len(ds))], "o",
                         label=f"{name}: layer {last}", **_style(name))
        axes[3].axhline(2 / (big * context), color="grey", linestyle="--", linewidth=0.8, label="uniform")
        axes[3].set(xscale="log", yscale="log", xlabel="passkey distance d (characters)",
                    ylabel="attention on the passkey (mean of the heads)", title="The NoPE layer at the question")
        axes[2].legend(fontsize=6, loc="upper right")
        axes[3].legend(fontsize=7)
    for ax in axes:
        ax.axvline(chunk, color="grey", linestyle=":", linewidth=0.8)
        ax.axvline(context, color="grey", linestyle="-.", linewidth=0.8)
    axes[0].legend(fontsize=7, title=f"dotted C = {chunk}, dash-dot T = {context}", title_fontsize=7)
    return common.save_figure(fig, out / "irope_length.png")


def _look(per_seed: list[dict], window: int, i: int, layer: int, how: str) -> float:
    """A layer's attention on the passkey at distance index `i` in windows of `window` contexts, mean over
    seeds: of the mean over its heads ("mean": uniform attention gives 2 / position) or of its top head."""
    heads = [s[str(window)][i][layer] for s in per_seed]
    return common.mean(common.mean(h) if how == "mean" else max(h) for h in heads)


def _style(name: str) -> dict:
    """One colour per layout in every panel; dashed for the temperature off, dotted for the blinded one (each
    often lies on its twin)."""
    colour = {v[0]: f"C{i}" for i, v in enumerate(VARIANTS)}.get(name)
    return {"color": colour, "linestyle": "--" if "no temperature" in name else ":" if "blind" in name else "-"}


def _cell(diffs: list[float]) -> str:
    test = common.paired_test(diffs)
    return f"{test.interval} {test.reading}"


def _points(diffs: list[float]) -> str:
    """A paired accuracy difference in points: higher or lower, a tie within ACCURACY_EFFECT, or undecided."""
    return common.higher_or_lower(diffs, ACCURACY_EFFECT, 1)
