"""The offline page of an `ExpertsReport` (`nanollama4 experts --html FILE`): one self-contained HTML file,
its markup, style and script in experts.html, filled and written as explain's page is (page.py).

Per MoE layer it draws the layer's specialisation numbers (for a run, beside its routing logged in
training, and with the untrained and geometry nulls when computed), a token-class x expert heatmap of each
expert's class share over the stream's, and per expert, the most specialised first, its load, what fills it
and what it owns with their contexts; then the paths.
Tokens and contexts come from a tokenizer and a text we did not write, so the script inserts every string
as text (`textContent`), never as markup, and the data travels as JSON with "<", ">" and "&" escaped.

The page carries the report as `report_dict` gives it, less each layer's `assignments` and
`dropped_by_token`: the full token x expert counts, which the page does not draw and which with a BPE
vocabulary would make it megabytes (the JSON, --json, keeps them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..explain.page import check_page_target, fill_page, write_html
from .experts import ExpertsReport
from .expertsview import report_dict, training_line

GENERATOR = "nanollama4 experts"  # named in the first line of every experts page: what marks it as ours
UNDRAWN = ("assignments", "dropped_by_token")  # per-layer counts the page leaves to the JSON


def page_data(report: ExpertsReport) -> dict[str, Any]:
    """What the page inlines: `report_dict(report)` without each layer's UNDRAWN counts, and for a run the line
    per MoE layer of its logged routing (`training_lines`, as the terminal words it: each declared statistic
    in its unit)."""
    data = report_dict(report)
    data["layers"] = [{k: v for k, v in layer.items() if k not in UNDRAWN} for layer in data["layers"]]
    if report.training is not None:
        data["training_lines"] = [training_line(report.training, i) for i in range(len(report.layers))]
    return data


def experts_html(report: ExpertsReport, title: str = "nanollama4 experts") -> str:
    """One self-contained page of the report: it loads nothing from anywhere (no CDN, fonts or images)."""
    n_experts = max((len(layer.experts) for layer in report.layers), default=0)
    return fill_page("experts.html", title, page_data(report), n_experts, home=__package__)


def check_experts_page_target(out: Path) -> None:
    """Refuse, before any work, an --html path that cannot be written, or that is a link or a file this
    command did not write (only our own page is replaced; there is no --force)."""
    check_page_target(out, generator=GENERATOR, can_force=False)


def write_experts_page(report: ExpertsReport, out: Path, title: str = "nanollama4 experts") -> None:
    """The report's page at `out`, written whole or not at all, never through a link."""
    write_html(experts_html(report, title), out)
