"""The views of an `ExpertsReport`: one terminal screen per MoE layer, and the JSON a notebook reads.

The JSON is the report's dataclasses as plain values (`report_dict`), written whole or not at all, and
never through a link or over a file nanollama4 experts did not write (`check_json_target`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base.errors import ConfigError
from ..base.files import atomic_write, check_output_target
from ..explain.terminal import terminal_console
from ..model.moe import ROUTING_STATISTICS
from .experts import (
    ExpertsReport,
    ExpertStat,
    GeometryLayer,
    LayerStat,
    TrainingRouting,
    UntrainedLayer,
    most_specialised,
)
from .specialise import Specialisation

if TYPE_CHECKING:
    from rich.console import Console

FORMAT = "nanollama4-experts/2"  # the JSON's "format": what marks a file as one this command wrote


def report_dict(report: ExpertsReport) -> dict[str, Any]:
    """The report as plain JSON values (what --json writes, and what json.loads of the file gives back)."""
    return {"format": FORMAT, **dataclasses.asdict(report)}


def check_json_target(out: Path) -> None:
    """Refuse, before any work, a --json path that is a link, a folder, in a folder that is not there or not
    writable, or a file this command did not write (we replace only our own)."""
    if os.path.islink(out):
        raise ConfigError(f"--json {out} is a symbolic link; give the path of a new file (a link is never written "
                          "through)")
    check_output_target(out, "--json", _is_ours, "a file nanollama4 experts wrote")


def check_outputs_apart(json_out: Path, html_out: Path) -> None:
    """Refuse, before any work, --json and --html naming one file: the page, written second, would replace
    the JSON (a file of ours, so neither target check objects). One file: the same path once links and
    ".." are resolved, the same file where it exists (a hard link), or names that differ only in letter
    case, which some filesystems (macOS, Windows) take for one name."""
    a, b = os.path.realpath(json_out), os.path.realpath(html_out)
    same = a.casefold() == b.casefold()
    if not same and os.path.exists(a) and os.path.exists(b):
        same = os.path.samefile(a, b)
    if same:
        raise ConfigError(f"--json {json_out} and --html {html_out} are one file, which the page would take over "
                          "from the JSON; give each its own file name")


def _is_ours(path: Path) -> bool:
    if not path.is_file():  # a pipe or a device is not opened to look
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return head.startswith(b'{"format": "' + FORMAT.rsplit("/", 1)[0].encode() + b"/")  # any version of ours


def write_json(report: ExpertsReport, out: Path) -> None:
    """The report at `out`, replacing it atomically (a link there is replaced, never written through)."""
    text = json.dumps(report_dict(report), ensure_ascii=False)
    atomic_write(Path(out), lambda p: Path(p).write_text(text, encoding="utf-8"))


def _quoted(token: str) -> str:
    """A token in quotes that are not in it (its escapes are already written: `errors.shown`)."""
    return f'"{token}"' if "'" in token else f"'{token}'"


def _mi(s: Specialisation, label: str = "expert") -> str:
    interval = (f", 95% interval {s.excess_low:.3f} to {s.excess_high:.3f} over {s.chunks} chunks"
                if s.excess_low is not None else "")
    return (f"{s.bits:.3f} bits (shuffled: {s.null_bits:.4f} ± {s.null_sd:.4f}); above the null {s.above_null:.3f}, "
            f"{s.normalised:.1%} of H({label}) {s.label_bits:.2f}; per chunk {s.excess_mean:.3f}{interval}")


def _brief(s: Specialisation) -> str:
    return f"{s.bits:.3f} bits, above its shuffle {s.above_null:.3f} ({s.normalised:.1%} of H {s.label_bits:.2f})"


SHOWN = 4  # tokens a terminal cell lists


def fills(e: ExpertStat, n: int = SHOWN) -> str:
    """What fills the expert: its commonest tokens with their share of its slots and their count."""
    return "  ".join(f"{_quoted(t.token)} {t.share:.0%} ({t.count:,})" for t in e.top_count[:n])


def owns(e: ExpertStat, min_support: int, n: int = SHOWN) -> str:
    """What the expert owns: the share of each token's occurrences it takes, of how many."""
    return "  ".join(f"{_quoted(t.token)} {t.owned:.0%} of {t.occurrences:,}" for t in e.top_owned[:n]) or \
        f"(no token reaches {min_support} here)"


def show_experts(report: ExpertsReport, console: Console | None = None) -> None:
    """Print the report: a header, one screen per MoE layer, then the paths."""
    console = console or terminal_console()
    console.print(f"{report.tokens:,} tokens in {report.windows:,} windows of {report.window} (non-overlapping: "
                  f"a window's first tokens see little context); {report.tokenizer} token classes", markup=False)
    console.print("fills: an expert's commonest tokens, % of its slots (count); owns: the tokens it takes most of, "
                  f"% of their occurrences (of how many), among those it took at least {report.min_support} times; "
                  "part: its share of first choices x how far its tokens are from the stream's, above the shuffle "
                  "(they sum to the layer's I(expert; token)); the most specialised are ranked by it",
                  markup=False, style="dim")
    untrained = {u.layer: u for u in report.untrained or []}
    geometry = {g.layer: g for g in report.geometry or []}
    for i, layer in enumerate(report.layers):
        trained = None if report.training is None else training_line(report.training, i)
        _show_layer(report, layer, console, untrained.get(layer.layer), trained, geometry.get(layer.layer))
    if report.paths is not None:
        _show_paths(report, console)


def _show_layer(report: ExpertsReport, layer: LayerStat, console: Console, untrained: UntrainedLayer | None,
                trained: str | None, geometry: GeometryLayer | None = None) -> None:
    from rich.table import Table

    console.print()
    head = f"layer {layer.layer}: {len(layer.experts)} experts"
    if layer.dropped:
        head += f", {layer.dropped:,} of {layer.slots:,} slots dropped (capacity)"
    if layer.shared_share is not None:
        head += f"; shared expert's share of the output {layer.shared_share:.2f}"
    console.print(head, markup=False, style="bold")
    for name, mi, null in (("token", layer.token_mi, untrained and untrained.token_mi),
                           ("class", layer.class_mi, untrained and untrained.class_mi)):
        console.print(f"  I(expert; {name}) {_mi(mi)}", markup=False)
        if null:
            console.print(f"    untrained (seed {report.untrained_seed}): {_mi(null)}", markup=False)
        if name == "token" and geometry is not None:
            console.print(f"    its own hidden states, fresh router (seed {report.geometry_seed}): "
                          f"{_brief(geometry.fresh_router)}; k-means: {_brief(geometry.kmeans)}", markup=False)
    if trained is not None:
        console.print(f"  in training (the run's last validation, step {report.training.step}): {trained}",
                      markup=False)
    uniform = 1 / max(len(layer.experts), 1)
    best = most_specialised(layer, 3)
    console.print("  most specialised (part above the shuffle): " + ", ".join(
        f"expert {e.expert} ({e.part_above_null:.3f} bits, load {e.load:.2f})" for e in best), markup=False)
    table = Table(show_edge=False, pad_edge=False)
    for name in ("expert", "load", "part (shuffled)", "fills (one context)", "owns", "classes (x the stream's share)"):
        table.add_column(name, overflow="fold")
    for e in layer.experts:
        filled = fills(e) or "(empty)"
        if e.top_count and e.top_count[0].contexts:
            filled += f"\n{e.top_count[0].contexts[0]}"
        over = sorted(((e.classes[c] / layer.classes[c], c) for c in layer.classes if layer.classes[c] > 0
                       and e.classes[c] > 0), reverse=True)[:3]
        table.add_row(str(e.expert), f"{e.load:.2f} ({e.load / uniform:.1f}x)",
                      f"{e.part_bits:.3f} ({e.part_null_bits:.3f})", filled, owns(e, report.min_support),
                      "  ".join(f"{c} {r:.1f}" for r, c in over))
    console.print(table)


def training_line(training: TrainingRouting, i: int) -> str:
    """Layer i's logged statistics, each in its declared unit (`moe.ROUTING_STATISTICS`)."""
    units = {stat.name: stat.unit for stat in ROUTING_STATISTICS}
    parts = []
    for stat in ROUTING_STATISTICS:
        if i < len(training.values.get(stat.name, ())):
            unit = stat.unit or units.get(stat.panel or "", "")  # a range's high: its panel's unit
            value = f"{stat.name} {training.values[stat.name][i] * stat.factor:.3g}"
            parts.append(f"{value} ({unit})" if unit else value)
    return "; ".join(parts) or "nothing logged for this layer"


def _show_paths(report: ExpertsReport, console: Console) -> None:
    paths = report.paths
    console.print()
    console.print(f"paths: the first expert in each MoE layer; {paths.distinct:,} distinct", markup=False, style="bold")
    console.print(f"  I(path; token) {_mi(paths.token_mi, 'path')}; best single layer (block {paths.best_layer}) "
                  f"{paths.best_layer_bits:.3f} bits", markup=False)
    if report.untrained_paths is not None:
        console.print(f"    untrained (seed {report.untrained_seed}): {_mi(report.untrained_paths, 'path')}",
                      markup=False)
    for p in paths.top:
        tokens = "  ".join(f"{_quoted(t.token)} {t.count}" for t in p.top_tokens[:6])
        console.print(f"  {'-'.join(map(str, p.experts))}  {p.share:.3f}  {tokens}", markup=False)
