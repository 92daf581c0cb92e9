"""The offline page of a trace: one self-contained HTML file, its markup, style and script in page.html.

page.html is the template, shipped as package data; `html` fills its two placeholders, the at-sign
names TITLE (the title, HTML-escaped) and DATA (the trace as JSON, with "<", ">" and "&" escaped), in a
single pass, so nothing a prompt contains is ever read as a placeholder. The filling and the safe writing
(`fill_page`, `check_page_target`, `write_html`) serve the experts page too (expertspage.py).
"""

from __future__ import annotations

import html as html_text
import json
import re
from importlib import resources
from pathlib import Path

from ..base.errors import GenerationError
from ..base.files import atomic_write, check_output_target
from . import palette
from .tracing import Trace, describe_attention

PAGE_SCORES_LIMIT = 4_000_000  # attention probabilities a page inlines (layers x heads x T x T)


def html(t: Trace, title: str = "nanollama4 explain") -> str:
    """One self-contained HTML page of a trace: the data inlined as JSON, drawn by a few KB of plain
    JavaScript into HTML and SVG; it loads nothing from anywhere (no CDN, no fonts, no images).
    Masked attention cells are null (a visible probability of 0 is not the same as a masked one)."""
    scores = sum(layer.attention.numel() for layer in t.layers)
    if scores > PAGE_SCORES_LIMIT:
        raise GenerationError(f"the page would inline {scores:,} attention probabilities (at most "
                              f"{PAGE_SCORES_LIMIT:,}); use a shorter prompt")
    data = {
        "tokens": t.tokens, "ids": t.ids, "embedding": list(t.embedding_shape),
        "next": [[tok, p] for tok, p in t.next_tokens],  # values as computed: the page rounds once, to show
        "layers": [{
            "index": layer.index, "kind": describe_attention(layer), "gqa": layer.gqa,
            "q": list(layer.q_shape), "k": list(layer.k_shape), "v": list(layer.v_shape),
            "experts": layer.experts, "n_experts": layer.n_experts,
            "weights": layer.weights,
            # what each slot's choice was made on, for the hover: logits, bias, the score the top-k took
            "logits": None if layer.router_logits is None else layer.router_logits.tolist(),
            "bias": None if layer.router_bias is None else layer.router_bias.tolist(),
            "choice": None if layer.choice_scores is None else layer.choice_scores.tolist(),
            "capacity": layer.capacity, "capacity_factor": layer.capacity_factor,
            "rerouted": layer.rerouted, "dropped": layer.dropped, "slot_kind": layer.slot_kind,
            "chunk": layer.chunk,
            "temperature": layer.temperature,
            "shared": layer.shared_share,
            "attention": [[[None if p == 0 else round(p, 4) for p in row] for row in head]
                          for head in layer.attention.tolist()],
        } for layer in t.layers],
    }
    n_experts = max((layer.n_experts or 0 for layer in t.layers), default=0)
    return fill_page("page.html", title, data, n_experts)


def script_json(data: object) -> str:
    """`data` as JSON safe to inline in a <script> element: no "<", ">" or "&" appears raw (token text such
    as "</script>" or "<!--" would end or change the element); JSON's \\u escapes say the same characters."""
    return (json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def fill_page(template: str, title: str, data: object, n_experts: int, home: str = __package__) -> str:
    """The `template` packaged in the folder `home` with the expert palette, then @TITLE@ (HTML-escaped) and
    @DATA@ (`script_json`) filled in a single pass, so nothing a text contains is ever read as a placeholder."""
    fills = {"TITLE": html_text.escape(title), "DATA": script_json(data)}
    page = palette.fill(_template(template, home), n_experts)  # before the data goes in: never read as a placeholder
    return re.sub(r"@(TITLE|DATA)@", lambda m: fills[m[1]], page)  # one pass: a prompt is never re-read


def _template(name: str, home: str) -> str:
    """A page template, read through importlib.resources so it is found in an installed wheel as in a checkout."""
    return resources.files(home).joinpath(name).read_text(encoding="utf-8")


EXPLAIN = "nanollama4 explain"  # the generator named in the first line of every explain page we write


def mark(generator: str) -> bytes:
    """What the first line of every page `generator` writes holds: what tells our pages from anyone else's."""
    return f'<meta name="generator" content="{generator}">'.encode()


MARK = mark(EXPLAIN)


def is_our_page(path: Path, generator: str = EXPLAIN) -> bool:
    """Whether `path` is a regular file that starts like a page `generator` made (so replacing it loses
    nothing of anyone else's). A link, a pipe or a device is never opened to look."""
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return mark(generator) in f.read(512)


def check_page_target(out: Path, force: bool = False, generator: str = EXPLAIN, can_force: bool = True) -> None:
    """Refuse, before any work, a page path that cannot be written or would replace a file of someone else's
    (anything not a page `generator` made, a planted link included, unless `force`)."""
    check_output_target(out, "--html", lambda path: force or is_our_page(path, generator),
                        f"a page {generator} wrote", " (or pass --force to replace it)" if can_force else "")


def write_html(page: str, out: Path) -> None:
    """`page` at `out`, written whole or not at all; a link there is replaced, never written through."""
    atomic_write(out, lambda p: Path(p).write_text(page, encoding="utf-8"))


def write_page(t: Trace, out: Path, title: str) -> None:
    """The trace's page at `out`, written whole or not at all."""
    write_html(html(t, title), out)


def notebook_html(t: Trace) -> str:
    """The page inside an iframe (its own document, so two traces in one notebook keep their scripts and
    element ids apart): what a Trace shows as in Jupyter (`Trace._repr_html_`)."""
    page = html(t).replace("&", "&amp;").replace('"', "&quot;")
    return f'<iframe srcdoc="{page}" style="width: 100%; height: 900px; border: 1px solid #ddd"></iframe>'
