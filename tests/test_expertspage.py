"""`nanollama4 experts --html`: the page holds every number of the report, hostile token text stays text
(in the raw HTML and, where Chromium is here, in the drawn page), and the page is written only where it
replaces nothing of anyone else's."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess

import numpy as np
import pytest
import torch

from nanollama4.base.config import preset
from nanollama4.explain import palette
from nanollama4.model.moe import ROUTING_STATISTICS
from nanollama4.model.tokenizer import CharTokenizer
from nanollama4.model.transformer import Transformer
from nanollama4.reports.experts import TrainingRouting, experts, most_specialised
from nanollama4.reports.expertspage import UNDRAWN, experts_html, page_data
from nanollama4.reports.expertsview import report_dict, training_line

from .helpers import assert_cli_error, run_cli
from .test_explain import CHROMIUM, CHROMIUM_FLAGS

pytestmark = pytest.mark.usefixtures("one_thread")
HOSTILE = "</script><img src=x onerror=alert(1)>"
TEXT = "The cat sat on the mat.\nA dog ran to 42 houses!\n" * 6 + HOSTILE + " the end."


@pytest.fixture(scope="module")
def report():
    """A random tiny char model's report on a text holding HTML, one token and its context made wholly
    hostile (as a BPE vocabulary or a user's text can make them)."""
    torch.manual_seed(0)
    tok = CharTokenizer.from_text(TEXT)
    model = Transformer(preset("tiny", vocab_size=tok.vocab_size, max_seq_len=32)).eval()
    r = experts(model, tok, np.array(tok.encode(TEXT)), batch=4, min_support=1, geometry=True)
    top = r.layers[0].experts[0].top_owned[0]
    top.token, top.contexts = HOSTILE, [f"before ⟦{HOSTILE}⟧ after", HOSTILE]
    return r


def _trained(report):
    """The report as `experts` makes it for a run: with the routing its last validation logged (step 7)."""
    values = {s.name: [0.25 * (i + 1) for i in range(len(report.layers))] for s in ROUTING_STATISTICS}
    return dataclasses.replace(report, training=TrainingRouting(7, values))


def _embedded(page: str) -> dict:
    return json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)[1])


def test_the_page_holds_every_number_of_the_report(report):
    page = experts_html(report)
    data, want = _embedded(page), report_dict(report)
    assert [set(layer) for layer in data["layers"]] == [set(layer) - set(UNDRAWN) for layer in want["layers"]]
    for layer in want["layers"]:
        for key in UNDRAWN:
            del layer[key]
    assert data == want and data == page_data(report)  # every layer's and expert's numbers, paths, nulls
    assert json.dumps({"experts": palette.expert_colors(4), "dropped": palette.DROPPED}) in page  # explain's colours
    assert len(data["layers"]) == 4 and all(len(layer["experts"]) == 4 for layer in data["layers"])
    trained = _trained(report)  # a run's page also carries each layer's line of its logged routing
    lines = [training_line(trained.training, i) for i in range(4)]
    assert _embedded(experts_html(trained)) == {**page_data(report), "training": report_dict(trained)["training"],
                                                "training_lines": lines}


def test_hostile_text_never_becomes_markup_in_the_raw_page(report):
    page = experts_html(report, title=f"nanollama4 experts: {HOSTILE}")
    assert page.count("</script>") == 2  # the data's and the script's own ends: none from a token or context
    assert "<img" not in page and "onerror=alert(1)>" not in page
    assert "\\u003c/script\\u003e\\u003cimg" in page  # the token is there, escaped
    assert f"<title>nanollama4 experts: {HOSTILE.replace('<', '&lt;').replace('>', '&gt;')}</title>" in page
    # the page itself loads nothing (no address, no source, no import): its markup and script less the data
    own = re.sub(r'(<script id="data" type="application/json">).*?(</script>)', r"\1\2", experts_html(report),
                 flags=re.S)
    assert set(re.findall(r"https?://[^\s\"'<>)]*", own)) == set()
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(|fetch\(|XMLHttpRequest|innerHTML", own)


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (.ci/run installs Debian's chromium)")
def test_the_page_draws_in_a_browser_and_hostile_text_stays_text(report, tmp_path):
    page = tmp_path / "experts.html"
    page.write_text(experts_html(_trained(report)), encoding="utf-8")
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert 'data-ready="yes"' in dom  # the script ran to its end
    drawn = re.findall(r'<tr class="training"><td>in training \(the run\'s last validation, step 7\)</td>'
                       r'<td>([^<]*)</td>', dom)
    assert drawn == [training_line(_trained(report).training, i) for i in range(len(report.layers))]
    assert "<img" not in dom  # no element was made from the text
    escaped = HOSTILE.replace("<", "&lt;").replace(">", "&gt;")
    assert f"before <mark>{escaped}</mark> after" in dom  # the marked token highlighted, as text
    cards = re.findall(r'<div class="expert" data-layer="(\d+)" data-expert="(\d+)" data-rank="(\d+)">', dom)
    assert cards == [(str(la.layer), str(e.expert), str(rank)) for la in report.layers
                     for rank, e in enumerate(most_specialised(la, len(la.experts)))]  # the most specialised first
    assert dom.count('<tr class="geometry">') == 2 * len(report.layers)  # fresh router and k-means, each layer
    assert "among those it took at least <span id=\"support\">1</span> times" in dom
    cells = re.findall(r'data-class="([^"]+)" data-expert="(\d+)" title="[^"]*: x([0-9.]+)"', dom)
    want = [(c, e.expert, e.classes[c] / la.classes[c]) for la in report.layers for c in report.classes
            if la.classes[c] > 0 for e in la.experts]
    assert len(cells) == len(want)  # a heatmap cell per layer, class present and expert, each with its ratio
    assert all(c == wc and int(e) == we and float(r) == pytest.approx(wr, abs=1e-3)
               for (c, e, r), (wc, we, wr) in zip(cells, want, strict=True))
    inks = re.findall(r'data-class="[^"]+"[^>]*style="background: rgb\((\d+), (\d+), (\d+)\); color: '
                      r'rgb\((\d+), (\d+), (\d+)\);"', dom)
    assert len(inks) == len(want)
    hexed = ["#" + "".join(f"{int(v):02x}" for v in rgb) for rgb in inks]
    assert all(palette.contrast(h[:7], "#" + h[7:]) >= 4.5 for h in hexed)  # every number reads on its colour


def test_html_is_written_and_replaces_only_its_own_page(tiny_run, tmp_path, capsys):
    page = tmp_path / "experts.html"
    for _ in range(2):  # the second run replaces the page it wrote
        rc, out, err = run_cli(["experts", str(tiny_run), "--tokens", "200", "--quiet", "--html", str(page)], capsys)
        assert rc == 0 and f"page: {page}" in out, err
    assert '<meta name="generator" content="nanollama4 experts">' in page.read_text()[:300]
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "link.html").symlink_to(victim)
    (tmp_path / "notes.html").write_text("<p>my notes</p>")
    explain_page = tmp_path / "explain.html"
    assert run_cli(["explain", str(tiny_run), "--prompt", "the", "--html", str(explain_page)], capsys)[0] == 0
    for name in ("link.html", "notes.html", "explain.html"):  # a link, someone's file, another command's page
        target = tmp_path / name
        before = target.read_bytes()
        rc, out, err = run_cli(["experts", str(tiny_run), "--quiet", "--html", str(target)], capsys)
        assert assert_cli_error(rc, err, "experts") == (
            f"nanollama4 experts: error: --html {target} exists and is not a page nanollama4 experts wrote; "
            "pick a new file name")
        assert out == "" and target.read_bytes() == before
    assert (tmp_path / "link.html").is_symlink() and victim.read_text() == "keep me"
