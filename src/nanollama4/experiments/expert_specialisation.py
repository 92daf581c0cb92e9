"""Experiment 8, do the experts specialise? Seed 004 pictures routed experts as specialists ("Expert 1: good
at verbs, Expert 2: dates and numbers, Expert 3: proper nouns"); seed 000 adds a shared expert "so common
features need not be relearned by every routed expert".

The demo's model and recipe on three seeds, with its shared expert and without one at the same active size
(top-2 of the same experts); then, at the first seed, the first arm again with a BPE tokenizer, on
Shakespeare and on Python source (this Python's standard library). Every run routes the first TOKENS of
its validation text (`explain.experts`, as `nanollama4 experts` does) and is read by layer: I(first expert;
token) and I(first expert; token class) in bits, against the shuffle null and an untrained twin (the same
config, fresh weights: what routing sorts with no training); I(path; token) against the best single layer;
and each layer's most specialised experts with their tokens by lift. The shared-expert claim is read as a
paired test over seeds of what training added to the routed experts' specialisation (trained minus
untrained bits), with the shared expert against without.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

from ..evaluation import validation_of_run
from ..explain.experts import experts
from ..explain.specialise import Specialisation
from . import common
from .sweep import Sweep, setting_of

TITLE = "Do the experts specialise? Shared expert on and off"
TOKENS, TINY_TOKENS = 200_000, 2_000  # validation tokens each run routes (its first ones)
EXTRA = ("BPE, Shakespeare", "BPE, Python source")  # the first arm again at the first seed, tokenizer "bpe"
BITS_EFFECT = 0.05  # bits: a smaller paired difference in specialisation is a tie
SPECIALISTS = 3  # experts listed per layer, the most specialised first


def python_source() -> str:
    """This Python's standard library, as a glob of its top-level modules: source code any machine has."""
    return str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")


def _spec(s: Specialisation) -> dict[str, Any]:
    return {"bits": s.bits, "shuffled": s.null_bits, "excess": [s.excess_mean, s.excess_low, s.excess_high]}


def read(run_dir: str, tokens: int) -> dict[str, Any]:
    """What `experts` (with its untrained twin) says of a run's best checkpoint on its first `tokens` validation
    tokens, reduced to what the report reads."""
    run = validation_of_run(run_dir, max_tokens=tokens)
    rep = experts(run.model, run.tokenizer, run.tokens, untrained=True)
    layers = []
    for lay, twin in zip(rep.layers, rep.untrained or [], strict=True):
        best = sorted(lay.experts, key=lambda e: -e.kl_bits)[:SPECIALISTS]
        layers.append({"layer": lay.layer, "token": _spec(lay.token_mi), "class": _spec(lay.class_mi),
                       "untrained_token": twin.token_mi.bits, "untrained_class": twin.class_mi.bits,
                       "shared_share": lay.shared_share,
                       "specialists": [{"expert": e.expert, "load": e.load, "kl_bits": e.kl_bits,
                                        "lift": [[t.token, t.lift, t.count] for t in e.top_owned[:5]],
                                        "classes": sorted(e.classes.items(), key=lambda c: -c[1])[:2],
                                        "context": (e.top_owned[0].contexts or [""])[0] if e.top_owned else ""}
                                       for e in best]})
    paths = None
    if rep.paths is not None:
        paths = {"bits": rep.paths.token_mi.bits, "shuffled": rep.paths.token_mi.null_bits,
                 "untrained": rep.untrained_paths.bits if rep.untrained_paths else None,
                 "best_layer": rep.paths.best_layer, "best_layer_bits": rep.paths.best_layer_bits,
                 "distinct": rep.paths.distinct}
    return {"tokens": rep.tokens, "tokenizer": rep.tokenizer, "classes": rep.classes, "layers": layers, "paths": paths}


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
        reads.setdefault(r.name, []).append(read(r.run_dir, tokens))
    cfg, tc = sweep.configs(sweep.arms[0], tiny)
    extras = []
    for name in EXTRA:
        data = python_source() if "Python" in name and not tiny else setting.data
        bpe = tc.replace(seed=sweep.seeds[0], max_steps=sweep.max_steps, tokenizer="bpe",
                         bpe_vocab_size=300 if tiny else tc.bpe_vocab_size)
        r = common.train_run(name, cfg, bpe, out, progress, data, sweep.score_tokens)
        extras.append(r)
        if progress:
            print(f"  reading the experts of {name} on {tokens:,} validation tokens", flush=True)
        reads[name] = [read(r.run_dir, tokens)]
    extra = {"reads": reads, "tokens": tokens, "python_source": python_source(), "sweep": sweep.to_dict()}
    return [common.save(out, "expert_specialisation", setting, [*results, *extras], extra), *report(out)]


def _mean_layers(per_seed: list[dict], key: str, field: str | None = None) -> list[float]:
    """Per layer, the mean over seeds of layers[key] (or layers[key][field])."""
    n = len(per_seed[0]["layers"])
    pick = (lambda lay: lay[key]) if field is None else (lambda lay: lay[key][field])
    return [common.mean(pick(s["layers"][i]) for s in per_seed) for i in range(n)]


def _learned(read_: dict, key: str) -> list[float]:
    """Per layer, trained minus untrained bits: what training added to the routing's specialisation."""
    return [lay[key]["bits"] - lay[f"untrained_{key}"] for lay in read_["layers"]]


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    doc, results = common.load_results(out)
    reads, names = doc["reads"], common.arm_names(doc)
    arms = [n for n in names if n in reads and n not in EXTRA]
    n_layers = len(next(iter(reads.values()))[0]["layers"])
    head = ["run", "measure", *[f"layer {i}" for i in range(n_layers)], "paths"]
    rows = []
    for name, per in reads.items():
        paths = [s["paths"] for s in per if s["paths"]]
        seeds = f" ({len(per)} seeds, mean)" if len(per) > 1 else ""
        tok = per[0]["tokenizer"]
        for label, key, field, path_key in (
                (f"I(expert; token), trained, {tok}", "token", "bits", "bits"),
                ("untrained twin", "untrained_token", None, "untrained"),
                ("shuffled", "token", "shuffled", "shuffled"),
                ("I(expert; class), trained", "class", "bits", None),
                ("untrained twin", "untrained_class", None, None)):
            values = _mean_layers(per, key, field)
            p = common.mean(x[path_key] for x in paths if x[path_key] is not None) if path_key and paths else None
            rows.append([name + seeds if label.startswith("I(expert; token)") else "", label,
                         *[f"{v:.3f}" for v in values], "-" if p is None else f"{p:.3f}"])
    table = (f"### Specialisation by layer, in bits ({doc['tokens']:,} validation tokens a run)\n\n"
             + common.markdown_table(head, rows)
             + "\n\nI(expert; token): how much the expert of a token's first slot says about which token it is; "
             "(class): about its class. Untrained twin: the same config with fresh weights routing the same text; "
             "shuffled: each layer's choices dealt to other tokens, every expert's load kept. Paths: the first "
             "expert in every MoE layer together, against the tokens.")
    if len(arms) == 2 and len(reads[arms[0]]) == len(reads[arms[1]]) >= 2:
        a, b = arms
        prow = []
        for key, label in (("token", "learned I(expert; token)"), ("class", "learned I(expert; class)")):
            cells = [_bits([x[i] - y[i] for x, y in zip((_learned(s, key) for s in reads[a]),
                                                          (_learned(s, key) for s in reads[b]), strict=True)])
                     for i in range(n_layers)]
            mean_cell = _bits([common.mean(_learned(s, key)) - common.mean(_learned(t, key))
                               for s, t in zip(reads[a], reads[b], strict=True)])
            prow.append([label, *cells, mean_cell])
        loss = common.paired_reading(results, a, b)
        tie, _ = common.largest_spread([r for r in results if r.name in arms])
        table += (f"\n\n### {a} minus {b}, paired by seed\n\n" + common.markdown_table(
            ["difference", *[f"layer {i}" for i in range(n_layers)], "mean over layers"], prow)
                  + f"\n\nlearned: trained minus untrained bits, per seed; mean [95% t-interval], a tie within "
                  f"+-{BITS_EFFECT} bits. Full validation loss, {a} minus {b}: {loss.interval}, {loss.reading} "
                  f"(seed-to-seed spread of the raw losses, largest of the two arms: {common.format_spread(tie)}).")
    lines = []
    for name, per in reads.items():
        first = per[0]
        lines.append(f"\n**{name}** (seed {_seed_of(results, name)}):\n")
        for lay in first["layers"]:
            share = lay["shared_share"]
            share = "" if share is None else f"; the shared expert's share of the output {share:.2f}"
            lines.append(f"- layer {lay['layer']}{share}:")
            for e in lay["specialists"]:
                tops = ", ".join(f"`{_code(t)}` x{lift:.1f}" for t, lift, _ in e["lift"]) or "(no token often enough)"
                kinds = ", ".join(f"{c} {v:.0%}" for c, v in e["classes"])
                lines.append(f"  - expert {e['expert']} ({e['kl_bits']:.2f} bits, load {e['load']:.2f}): {tops}; "
                             f"{kinds}")
    table += ("\n\n### The most specialised experts of each layer, top tokens by lift\n\nRanked by how far the "
              "tokens an expert is first choice of are from the stream's (D(P(token | expert) || P(token)), bits); "
              "load: its share of the layer's slots; then its two largest token classes.\n" + "\n".join(lines))
    return [common.write_table(out, table), _plot(out, reads, n_layers)]


def _plot(out: Path, reads: dict[str, list[dict]], n_layers: int) -> Path:
    fig, axes = common.figure(ncols=2, width=5.5, height=4.2)
    layers = list(range(n_layers))
    for (name, per), colour in zip(reads.items(), ("C0", "C1", "C2", "C3", "C4", "C5"), strict=False):
        for ax, key in zip(axes, ("token", "class"), strict=True):
            ax.plot(layers, _mean_layers(per, key, "bits"), "o-", color=colour, label=f"{name}, trained")
            ax.plot(layers, _mean_layers(per, f"untrained_{key}"), "o--", color=colour, alpha=0.6,
                    label=f"{name}, untrained twin")
    for ax, key in zip(axes, ("token", "token class"), strict=True):
        ax.set(xlabel="MoE layer", ylabel="bits", title=f"I(first expert; {key})", xticks=layers)
    axes[0].legend(fontsize=7)
    return common.save_figure(fig, out / "expert_specialisation.png")


def _seed_of(results: list[common.ArmResult], name: str) -> str:
    return next((str(r.seed) for r in results if r.name == name), "?")


def _code(token: str) -> str:
    return token.replace("`", "'").replace("|", "\\|")


def _bits(diffs: list[float]) -> str:
    return common.higher_or_lower(diffs, BITS_EFFECT, 3)
