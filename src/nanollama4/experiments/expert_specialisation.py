"""Experiment 8, do the experts specialise? Seed 004 pictures routed experts as specialists ("Expert 1: good
at verbs, Expert 2: dates and numbers, Expert 3: proper nouns"); seed 000 adds a shared expert "so common
features need not be relearned by every routed expert".

The demo's model and recipe on three seeds: with its shared expert (top-1 + shared), without one at the same
active size by top-2 of the same experts, and without one at top-1 with experts twice as wide, so that the
shared expert (k = 1 both) and k (no shared expert both) are each changed alone. Then, at the first seed, the
first arm again with a BPE tokenizer, on Shakespeare and on Python source (this Python's standard library).
Every run routes the first TOKENS of its validation text (`reports.experts`, as `nanollama4 experts` does)
and is read by layer: I(first expert; token) and I(first expert; token class) above the shuffle null, and
against two nulls that need another model: the untrained twin drawn from the run's own seed (the same config
with fresh weights: what routing sorts with no training), and the geometry null (the run's own hidden states
routed by a fresh router and by k-means: what the representation sorts before any router learns). Then
I(path; token) against the best single layer, and each layer's most specialised experts (their part of I
above the shuffle, load weighed in) with what fills them and what they own. The shared-expert claim is read
as paired tests over seeds of what training added (trained minus the seed's untrained twin, above the null).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

from ..reports.experts import KMEANS_FIT, MIN_SUPPORT, ExpertStat, experts, most_specialised
from ..reports.specialise import Specialisation
from ..training.evaluation import validation_of_run
from . import common
from .sweep import Sweep, setting_of

TITLE = "Do the experts specialise? Shared expert on and off"
TOKENS, TINY_TOKENS = 200_000, 2_000  # validation tokens each run routes (its first ones)
EXTRA = ("BPE, Shakespeare", "BPE, Python source")  # the first arm again at the first seed, tokenizer "bpe"
TINY_PYTHON = "functools.py"  # a --tiny run's stand-in for the standard library: one module of it
BITS_EFFECT = 0.05  # bits: a smaller paired difference in specialisation is a tie
SPECIALISTS = 3  # experts listed per layer, the most specialised first
SHOWN = 4  # tokens listed per expert, what fills it and what it owns
# (a, b, what differs): the paired readings, each arm pair present in the sweep
PAIRS = (("shared expert", "no shared expert (k=1)", "the shared expert alone (top-1 both)"),
         ("no shared expert (k=1)", "no shared expert (k=2)", "k alone (no shared expert both)"),
         ("shared expert", "no shared expert (k=2)", "both at once (top-1 + shared against top-2)"))


def python_source(tiny: bool = False) -> str:
    """This Python's standard library, as a glob of its top-level modules: source code any machine has (for
    a --tiny run, one module of it)."""
    return str(Path(sysconfig.get_paths()["stdlib"]) / (TINY_PYTHON if tiny else "*.py"))


def _spec(s: Specialisation) -> dict[str, Any]:
    return {"bits": s.bits, "shuffled": s.null_bits, "above": s.above_null, "normalised": s.normalised,
            "excess": [s.excess_mean, s.excess_low, s.excess_high]}


def _expert(e: ExpertStat) -> dict[str, Any]:
    return {"expert": e.expert, "load": e.load, "part": e.part_above_null,
            "fills": [[t.token, t.share, t.count] for t in e.top_count[:SHOWN]],
            "owns": [[t.token, t.owned, t.occurrences] for t in e.top_owned[:SHOWN]],
            "classes": sorted(e.classes.items(), key=lambda c: -c[1])[:2]}


def read(run_dir: str, tokens: int, seed: int) -> dict[str, Any]:
    """What `experts` (with the untrained twin and the geometry null, both drawn from the run's own `seed`)
    says of a run's best checkpoint on its first `tokens` validation tokens, reduced to what the report reads."""
    run = validation_of_run(run_dir, max_tokens=tokens)
    rep = experts(run.model, run.tokenizer, run.tokens, untrained=True, geometry=True, seed=seed)
    layers = []
    for lay, twin, geo in zip(rep.layers, rep.untrained or [], rep.geometry or [], strict=True):
        layers.append({"layer": lay.layer, "token": _spec(lay.token_mi), "class": _spec(lay.class_mi),
                       "untrained_token": _spec(twin.token_mi), "untrained_class": _spec(twin.class_mi),
                       "fresh_router": _spec(geo.fresh_router), "kmeans": _spec(geo.kmeans),
                       "shared_share": lay.shared_share,
                       "specialists": [_expert(e) for e in most_specialised(lay, SPECIALISTS)]})
    paths = None
    if rep.paths is not None:
        paths = {"token": _spec(rep.paths.token_mi),
                 "untrained_token": _spec(rep.untrained_paths) if rep.untrained_paths else None,
                 "best_layer": rep.paths.best_layer, "best_layer_bits": rep.paths.best_layer_bits,
                 "distinct": rep.paths.distinct}
    return {"seed": seed, "tokens": rep.tokens, "tokenizer": rep.tokenizer, "classes": rep.classes,
            "layers": layers, "paths": paths}


def run(out: Path, sweep: Sweep, results: list[common.ArmResult], progress: bool = True, tiny: bool = False
        ) -> list[Path]:
    """Read every arm's runs (`results`), train and read the two BPE runs, then write results.json, table.md
    and the plot."""
    setting = setting_of(sweep, tiny)
    tokens = TINY_TOKENS if tiny else TOKENS
    order = {s: i for i, s in enumerate(sweep.seeds)}
    reads: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: order[r.seed]):
        if progress:
            print(f"  reading the experts of {r.name} (seed {r.seed}) on {tokens:,} validation tokens", flush=True)
        reads.setdefault(r.name, []).append(read(r.run_dir, tokens, r.seed))
    cfg, tc = sweep.configs(sweep.arms[0], tiny)
    extras = []
    for name in EXTRA:
        data = python_source(tiny) if "Python" in name else setting.data
        bpe = tc.replace(seed=sweep.seeds[0], max_steps=sweep.max_steps, tokenizer="bpe",
                         bpe_vocab_size=300 if tiny else tc.bpe_vocab_size)
        r = common.train_run(name, cfg, bpe, out, progress, data, sweep.score_tokens)
        extras.append(r)
        if progress:
            print(f"  reading the experts of {name} on {tokens:,} validation tokens", flush=True)
        reads[name] = [read(r.run_dir, tokens, r.seed)]
    stand_ins = {"BPE, Python source": f"Python source is one module of the standard library ({TINY_PYTHON}), "
                                       "not all of it"} if tiny else {}
    extra = {"reads": reads, "tokens": tokens, "python_source": python_source(tiny), "stand_ins": stand_ins,
             "sweep": sweep.to_dict()}
    return [common.save(out, "expert_specialisation", setting, [*results, *extras], extra), *report(out)]


def _above(lay: dict, key: str) -> float:
    return lay[key]["above"]


def _per_layer(per_seed: list[dict], pick) -> list[list[float]]:
    """Per layer, the value `pick(layer)` of each seed."""
    return [[pick(s["layers"][i]) for s in per_seed] for i in range(len(per_seed[0]["layers"]))]


def _cell(values: list[float]) -> str:
    """A mean with each seed's value after it (one seed: the value)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{common.mean(values):.3f} ({', '.join(f'{v:.2f}' for v in values)})"


ROWS = (  # label, the per-layer value, the paths' value (None: not for paths)
    ("I(expert; token) above the shuffle, trained", lambda lay: _above(lay, "token"),
     lambda p: p["token"]["above"]),
    ("untrained twin (its seed)", lambda lay: _above(lay, "untrained_token"),
     lambda p: p["untrained_token"]["above"] if p["untrained_token"] else float("nan")),
    ("its hidden states, fresh router", lambda lay: _above(lay, "fresh_router"), None),
    ("its hidden states, k-means", lambda lay: _above(lay, "kmeans"), None),
    ("the shuffle null itself", lambda lay: lay["token"]["shuffled"], lambda p: p["token"]["shuffled"]),
    ("share of H(expert) above the shuffle, trained", lambda lay: lay["token"]["normalised"], None),
    ("I(expert; class) above the shuffle, trained", lambda lay: _above(lay, "class"), None),
    ("untrained twin (its seed)", lambda lay: _above(lay, "untrained_class"), None),
)


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    doc, results = common.load_results(out)
    reads = doc["reads"]
    n_layers = len(next(iter(reads.values()))[0]["layers"])
    head = ["run", "measure", *[f"layer {i}" for i in range(n_layers)], "paths"]
    rows = []
    for name, per in reads.items():
        seeds = ", ".join(str(s["seed"]) for s in per)
        paths = [s["paths"] for s in per if s["paths"]]
        for i, (label, pick, path_pick) in enumerate(ROWS):
            cells = [_cell(v) for v in _per_layer(per, pick)]
            p = _cell([path_pick(x) for x in paths]) if path_pick and len(paths) == len(per) else "-"
            rows.append([f"{name} (seeds {seeds})" if i == 0 else "", label, *cells, p])
    stand_ins = "".join(f" {k}: {v} (a --tiny stand-in)." for k, v in doc.get("stand_ins", {}).items())
    tiny = ("--tiny: this design at a small size (tiny models, 3 steps an arm): its numbers test the code and "
            "mean nothing, and of its many 95% intervals a few decide by chance.\n\n"
            if doc["setting"].get("tiny") else "")
    table = tiny + (f"### Specialisation by layer, in bits above the shuffle null ({doc['tokens']:,} validation "
             "tokens a run; the mean, then each seed's value)\n\n" + common.markdown_table(head, rows)
             + "\n\nI(expert; token): how much the expert of a token's first slot says about which token it is, "
             "less the same for the choices shuffled over the tokens (every expert's load kept), whose own value "
             "is the shuffle row; (class): about its class. Untrained twin: the same config with fresh weights "
             "drawn from the run's own seed, routing the same text. Fresh router, k-means: the trained model's own "
             "hidden states at the layer routed by the twin's router or by the nearest of as many k-means centroids "
             f"as experts (fitted on the first {KMEANS_FIT:,} tokens): what the representation sorts without the "
             "router's training. "
             "Share of H(expert): the excess over the routing's own information, which compares across expert "
             "counts. Paths: the first expert in every MoE layer together." + stand_ins)
    losses = [[name, ", ".join(f"{r.full_val_loss:.4f}" for r in results if r.name == name),
               f"{common.mean(r.full_val_loss for r in results if r.name == name):.4f}"] for name in reads]
    table += ("\n\n### Full validation loss (nats a token: a character, or a BPE token)\n\n"
              + common.markdown_table(["run", "each seed", "mean"], losses))
    for a, b, what in PAIRS:
        if a in reads and b in reads and len(reads[a]) == len(reads[b]) >= 2:
            table += _paired(a, b, what, reads, results, n_layers)
    lines = []
    for name, per in reads.items():
        first = per[0]
        lines.append(f"\n**{name}** (seed {first['seed']}):\n")
        for lay in first["layers"]:
            share = lay["shared_share"]
            share = "" if share is None else f"; the shared expert's share of the output {share:.2f}"
            lines.append(f"- layer {lay['layer']}{share}:")
            for e in lay["specialists"]:
                fills = ", ".join(f"`{_code(t)}` {v:.0%}" for t, v, _ in e["fills"]) or "(empty)"
                owns = ", ".join(f"`{_code(t)}` {v:.0%} of {n:,}" for t, v, n in e["owns"]) or "(none often enough)"
                kinds = ", ".join(f"{c} {v:.0%}" for c, v in e["classes"])
                lines.append(f"  - expert {e['expert']} ({e['part']:.3f} bits, load {e['load']:.2f}): fills {fills}; "
                             f"owns {owns}; {kinds}")
    table += ("\n\n### The most specialised experts of each layer: what fills them, what they own\n\nRanked by "
              "their part of the layer's I(expert; token) above the shuffle (their share of first choices x how far "
              "their tokens are from the stream's, so that a near-empty expert is not first); load: its share of "
              "the layer's slots; fills: its commonest tokens, their share of its slots; owns: the tokens it takes "
              "the largest share of (of their occurrences, of how many), among those it took at least "
              f"{MIN_SUPPORT} times; then its two largest token classes.\n" + "\n".join(lines))
    return [common.write_table(out, table), _plot(out, reads, n_layers)]


def _paired(a: str, b: str, what: str, reads: dict[str, list[dict]], results: list[common.ArmResult],
            n_layers: int) -> str:
    """The paired table of arm a minus arm b over their seeds, with each seed's difference."""
    prow, seeds_rows = [], []
    for label, learned in (
            ("learned I(expert; token): trained minus its untrained twin",
             lambda lay: _above(lay, "token") - _above(lay, "untrained_token")),
            ("beyond geometry: trained minus the fresh router on its hidden states",
             lambda lay: _above(lay, "token") - _above(lay, "fresh_router")),
            ("learned I(expert; class): trained minus its untrained twin",
             lambda lay: _above(lay, "class") - _above(lay, "untrained_class"))):
        da, db = _per_layer(reads[a], learned), _per_layer(reads[b], learned)
        diffs = [[x - y for x, y in zip(da[i], db[i], strict=True)] for i in range(n_layers)]
        per_seed = [common.mean(diffs[i][j] for i in range(n_layers)) for j in range(len(reads[a]))]
        prow.append([label, *[_bits(d) for d in diffs], _bits(per_seed)])
        seeds_rows.append([label, *[", ".join(f"{x:+.3f}" for x in d) for d in diffs],
                           ", ".join(f"{x:+.3f}" for x in per_seed)])
    loss = common.paired_reading(results, a, b)
    tie, _ = common.largest_spread([r for r in results if r.name in (a, b)])
    seeds = ", ".join(str(s["seed"]) for s in reads[a])
    cols = ["difference", *[f"layer {i}" for i in range(n_layers)], "mean over layers"]
    return (f"\n\n### {a} minus {b}: {what}, paired by seed\n\n" + common.markdown_table(cols, prow)
            + f"\n\nEach seed's difference (seeds {seeds}):\n\n" + common.markdown_table(cols, seeds_rows)
            + f"\n\nBits above the shuffle null; mean [95% t-interval], a tie within +-{BITS_EFFECT} bits. Full "
            f"validation loss, {a} minus {b}: {loss.interval}, {loss.reading} (seed-to-seed spread of the raw "
            f"losses, largest of the two arms: {common.format_spread(tie)}).")


def _plot(out: Path, reads: dict[str, list[dict]], n_layers: int) -> Path:
    fig, (*axes, legend) = common.figure(ncols=3, width=4.6, height=4.2)  # the third holds the legend
    layers = list(range(n_layers))
    for (name, per), colour in zip(reads.items(), ("C0", "C1", "C2", "C3", "C4", "C5"), strict=False):
        for ax, key in zip(axes, ("token", "class"), strict=True):
            mean = [common.mean(v) for v in _per_layer(per, lambda lay, k=key: _above(lay, k))]
            twin = [common.mean(v) for v in _per_layer(per, lambda lay, k=key: _above(lay, f"untrained_{k}"))]
            ax.plot(layers, mean, "o-", color=colour, label=f"{name}, trained")
            ax.plot(layers, twin, "o--", color=colour, alpha=0.6, label=f"{name}, untrained twin")
    for ax, key in zip(axes, ("token", "token class"), strict=True):
        ax.set(xlabel="MoE layer", ylabel="bits above the shuffle null", title=f"I(first expert; {key})",
               xticks=layers)
    legend.axis("off")
    legend.legend(*axes[0].get_legend_handles_labels(), loc="center left", fontsize=8, frameon=False)
    return common.save_figure(fig, out / "expert_specialisation.png")


def _code(token: str) -> str:
    return token.replace("`", "'").replace("|", "\\|")


def _bits(diffs: list[float]) -> str:
    return common.higher_or_lower(diffs, BITS_EFFECT, 3)
