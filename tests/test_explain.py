"""Explain mode: the trace reports what the forward pass did, and leaves the model as it was."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import matplotlib.image
import pytest
import torch
from rich.console import Console

import nanollama4
from nanollama4.explain import html, routing_lines, show, trace
from nanollama4.model.moe import MoE
from nanollama4.model.tokenizer import BPETokenizer, CharTokenizer
from nanollama4.ops.attention import cpu_autocast_attend
from tests.helpers import randomize_, run_cli, write_corpus

TEXT = "Facebook was founded in 2004 by Mark Zuckerberg and his college roommates."


def _model(router: str, vocab: int) -> nanollama4.Transformer:
    torch.manual_seed(0)
    model = nanollama4.build_model(nanollama4.preset("tiny", vocab_size=vocab, moe_every=2, router=router))
    randomize_(model, seed=3)  # varied routing (the default init routes almost uniformly)
    return model.eval()


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_trace_and_terminal_report_the_routers_own_decisions(router):
    tok = CharTokenizer.from_text(TEXT)
    model = _model(router, tok.vocab_size)
    prompt = "Facebook was founded"
    ids = torch.tensor([tok.encode(prompt)])
    moe_inputs = {}  # computed separately: a plain pass, capturing each MoE layer's input, then its router
    hooks = [m.register_forward_pre_hook(lambda m, args: moe_inputs.__setitem__(m, args[0].detach()))
             for m in model.modules() if isinstance(m, MoE)]
    with torch.no_grad():
        logits = model(ids)
        want = {m: m.route(x.reshape(-1, x.shape[-1])) for m, x in moe_inputs.items()}
    for h in hooks:
        h.remove()

    t = trace(model, tok, prompt)
    out = io.StringIO()
    show(t, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    moe_layers = [layer for layer in t.layers if layer.experts is not None]
    assert [layer.index for layer in moe_layers] == [1, 3]
    for layer in moe_layers:
        r = want[model.blocks[layer.index].ffn]
        assert layer.experts == r.experts_TK.tolist()
        torch.testing.assert_close(torch.tensor(layer.weights), r.weights_TK, atol=1e-6, rtol=0)
        for token, line in zip(t.tokens, routing_lines(layer), strict=True):
            assert f"{token!r} → {line}" in text
        for row, weights in zip(r.experts_TK.tolist(), r.weights_TK.tolist(), strict=True):
            assert ", ".join(f"expert {e} ({w:.2f})" for e, w in zip(row, weights, strict=True)) in text
        assert 0 < layer.shared_share < 10
    assert len({tuple(row) for layer in moe_layers for row in layer.experts}) > 2  # routing really varies
    probs = logits[0, -1].softmax(-1)
    top = probs.topk(10)
    assert [tok.decode([int(i)]) for i in top.indices] == [name for name, _ in t.next_tokens]
    assert [p for _, p in t.next_tokens] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_attention_is_what_the_layer_attended_with_and_the_model_is_left_as_it_was():
    tok = CharTokenizer.from_text(TEXT)
    model = _model("sigmoid", tok.vocab_size)
    prompt = "Facebook was"  # 12 tokens, chunk 8: RoPE layers see only their own block of 8
    t = trace(model, tok, prompt)
    assert all(b.attn.attend is cpu_autocast_attend for b in model.blocks)  # the recorders are gone again
    assert not any("route" in vars(m) for m in model.modules() if isinstance(m, MoE))
    assert not any(m._forward_hooks for m in model.modules())
    for layer in t.layers:
        a = layer.attention  # (H, T, T)
        assert a.shape == (4, 12, 12)
        torch.testing.assert_close(a.sum(-1), torch.ones(4, 12))
        assert (a.triu(1) == 0).all()  # causal
        if layer.chunk:
            assert (a[:, 8:, :8] == 0).all() and (a[:, 9, 8:10] > 0).all()
        else:
            assert (a[:, 9, :10] > 0).all()
    assert [layer.kind for layer in t.layers] == ["rope", "rope", "rope", "nope"]
    assert t.layers[0].gqa == "4 query heads share 2 KV heads"
    assert t.embedding_shape == (1, 12, 64)
    assert any(name == "blocks.1.ffn.router" for name, _, _ in t.modules)


@pytest.mark.parametrize("numbering", ["from 0", "from 8", "with a gap"])
def test_an_observed_pass_attends_as_the_unobserved_one_whatever_the_positions(numbering):
    """The model attends chunk by chunk only where it numbers the positions itself from a chunk boundary; the
    recorder does so only where the positions it is handed are such a numbering, so explicit positions (with
    a gap here, where chunk by chunk would be wrong) are observed as they are computed."""
    from nanollama4.engine.observe import observe

    model = _model("sigmoid", 40)
    ids = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(3))
    given = {"from 0": None, "from 8": torch.arange(8, 28),
             "with a gap": torch.cat([torch.arange(5), torch.arange(9, 24)])}
    positions = given[numbering]
    with torch.no_grad():
        plain = model(ids, positions=positions)
        with observe(model):
            seen = model(ids, positions=positions)
    assert torch.equal(seen, plain)


def test_an_empty_sequence_is_an_empty_answer():
    model = _model("sigmoid", 40)
    with torch.no_grad():
        assert model(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_traced_pass_is_the_plain_pass_bit_for_bit(dtype):
    """The recorder hands back the real backend's output, so nothing downstream drifts (in bf16 an output
    computed by the recorder itself differed from SDPA's in a third of its elements)."""
    tok = CharTokenizer.from_text(TEXT)
    model = _model("sigmoid", tok.vocab_size).to(dtype)
    ids = torch.tensor([tok.encode("Facebook was founded")])
    with torch.no_grad():
        plain = model(ids)
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o))
    t = trace(model, tok, "Facebook was founded")
    assert torch.equal(seen[-1], plain)
    assert t.layers[0].attention.dtype == torch.float32


def test_a_failing_pass_leaves_no_observer_behind(monkeypatch):
    tok = CharTokenizer.from_text(TEXT)
    model = _model("softmax", tok.vocab_size)
    model.blocks[2].train()  # a mixed train/eval model keeps its modes too
    monkeypatch.setattr(model.blocks[3], "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        trace(model, tok, "Facebook")
    assert all(b.attn.attend is cpu_autocast_attend for b in model.blocks)
    assert not any("route" in vars(m) for m in model.modules() if isinstance(m, MoE))
    assert not any(m._forward_hooks for m in model.modules())
    assert model.blocks[2].training and not model.blocks[1].training


def test_the_page_escapes_whatever_the_prompt_holds(tmp_path):
    hostile = '@DATA@ </script><!--<script> "q" & <img src=x onerror=alert(1)>'
    tok = CharTokenizer.from_text(hostile + TEXT)
    t = trace(_model("sigmoid", tok.vocab_size), tok, hostile)
    page = html(t, f"nanollama4 explain: {hostile!r}")
    assert "<img" not in page and "<!--<script>" not in page
    assert page.count("</script>") == 2  # the data's and the code's, nothing from the prompt
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)[1])
    assert "".join(data["tokens"]) == hostile
    title = re.search(r"<title>(.*?)</title>", page, re.S)[1]
    assert '"tokens"' not in title and "&lt;img src=x" in title  # the prompt, as text, and not the data


def test_prompts_from_one_token_to_the_whole_context():
    tok = CharTokenizer.from_text(TEXT)
    model = _model("softmax", tok.vocab_size)
    for n in (1, model.cfg.max_seq_len):
        t = trace(model, tok, (TEXT * 2)[:n])
        assert len(t.tokens) == n and all(layer.attention.shape[-1] == n for layer in t.layers)
    with pytest.raises(nanollama4.base.errors.GenerationError, match="more than the model's max_seq_len"):
        trace(model, tok, (TEXT * 2)[: model.cfg.max_seq_len + 1])


def test_explain_on_a_run_and_on_a_reference_checkpoint_with_bpe(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path / "corpus.txt")
    rc, _, err = run_cli(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(tmp_path / "run"),
                          "--max-steps", "2", "--set", "batch_size=4", "--set", "seq_len=32", "--quiet"], capsys)
    assert rc == 0, err
    page = tmp_path / "page.html"
    rc, out, err = run_cli(["explain", str(tmp_path / "run"), "--prompt", "the cat", "--trace", "--html", str(page)],
                           capsys)
    assert rc == 0 and err == "", err
    assert f"page: {page}" in out and '"tokens":["t","h","e"," ","c","a","t"]' in page.read_text()
    assert "layer 3: NoPE + full causal attention + temperature tuning" in out
    assert "'t' → expert" in out and "every module call" in out and "blocks.0.attn.q_proj" in out

    bpe = BPETokenizer.train(corpus.read_text(), 300)
    torch.manual_seed(0)
    model = nanollama4.build_model(nanollama4.preset("tiny", vocab_size=bpe.vocab_size))
    hf = tmp_path / "hf"
    nanollama4.export_hf(model, hf)
    bpe.save(hf / "tokenizer.json")
    rc, out, err = run_cli(["explain", str(hf), "--prompt", "the quick brown fox"], capsys)
    assert rc == 0, err
    assert "next token after the prompt" in out and "layer 0: RoPE + chunked attention (blocks of 8)" in out


# ---------------------------------------------------------------------------------------------- the page
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-headless-shell")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _demo_page(tmp_path: Path, n_tokens: int = 64) -> tuple[Path, nanollama4.explain.Trace]:
    text = (TEXT + " ") * 3
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    model = nanollama4.build_model(nanollama4.preset("shakespeare-char", vocab_size=tok.vocab_size)).eval()
    randomize_(model, seed=5)
    t = trace(model, tok, text[:n_tokens])
    page = tmp_path / "report.html"
    page.write_text(html(t), encoding="utf-8")
    return page, t


def test_the_page_is_self_contained_and_small(tmp_path):
    page, t = _demo_page(tmp_path)
    content = page.read_text()
    assert page.stat().st_size < 1_000_000, page.stat().st_size  # 64 tokens on the demo model
    # no address to load: the only URI is the SVG namespace, which names and is never fetched
    assert set(re.findall(r"https?://[^\s\"'<>)]*", content)) == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(|fetch\(|XMLHttpRequest", content)
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', content, re.S)[1])
    assert data["tokens"] == t.tokens and len(data["layers"]) == 4


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (.ci/run installs Debian's chromium)")
def test_the_page_draws_the_routing_grid_in_a_browser(tmp_path):
    page, t = _demo_page(tmp_path, n_tokens=40)
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert 'data-ready="yes"' in dom  # the script ran to its end
    moe_layers = [layer for layer in t.layers if layer.experts is not None]
    cells = re.findall(r'<td class="cell" data-layer="(\d+)" data-token="(\d+)"', dom)
    assert sorted(cells) == sorted((str(layer.index), str(i)) for layer in moe_layers for i in range(40))
    for layer in moe_layers:  # each cell names its token's experts and, on hover, what each was chosen on
        for i in (0, 17, 39):
            biases = [f", bias {b:.3f}" for b in layer.router_bias] if layer.router_bias is not None \
                else [""] * layer.n_experts
            title = "&#10;".join(f"expert {e}: router logit {layer.router_logits[i, e]:.3f}{biases[e]}, choice score "
                                 f"{layer.choice_scores[i, e]:.3f}, weight {w:.3f}"
                                 for e, w in zip(layer.experts[i], layer.weights[i], strict=True))
            kinds = " ".join(layer.slot_kind[i])
            assert f'data-layer="{layer.index}" data-token="{i}" data-kinds="{kinds}" title="{title}"' in dom
    assert dom.count('id="heatmap"') == 1
    bars = re.findall(r'<svg width="\d+" height="134" data-layer="(\d+)">(.*?)</svg>', dom)
    assert [int(i) for i, _ in bars] == [layer.index for layer in moe_layers]
    assert all(body.count("<rect") == t.layers[int(i)].n_experts for i, body in bars)  # one bar per expert
    assert all(body.count("<title>expert ") == t.layers[int(i)].n_experts for i, body in bars)  # counts on hover
    heatmap = re.search(r'<svg [^>]*id="heatmap">(.*?)</svg>', dom, re.S)[1]
    labels = [re.findall(rf'class="{axis}"[^>]*>([^<]*)<', heatmap) for axis in ("qlabel", "klabel")]
    assert labels[0] == labels[1] == [json.dumps(tok)[:8].replace("&", "&amp;") for tok in t.tokens]  # both axes
    hovers = re.findall(r'<rect [^>]*class="att"><title>query (\d+) .*? key (\d+) .*?: ([0-9.]+)</title>', heatmap)
    assert len(hovers) == sum(p > 0 for p in t.layers[0].attention[0].flatten().tolist())  # a value per cell
    q, k, value = hovers[-1]
    assert float(value) == pytest.approx(t.layers[0].attention[0][int(q), int(k)].item(), abs=1e-4)
    assert "probability" in heatmap  # the colour scale
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    pixels = matplotlib.image.imread(shot)[..., :3]
    colourful = (pixels.max(-1) - pixels.min(-1) > 0.3).mean()  # the grid's expert colours, the heatmap
    assert pixels.std() > 0.05 and colourful > 0.02, (pixels.std(), colourful)


def test_html_replaces_only_its_own_pages_unless_forced(tiny_run, tmp_path, capsys):
    """`explain --html FILE` used to overwrite any file, the run's own model.safetensors included."""
    from tests.helpers import assert_cli_error

    foreign = tmp_path / "notes.html"
    foreign.write_text("<p>my notes</p>")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "link.html"
    link.symlink_to(victim)
    model_file = tiny_run / "last" / "model.safetensors"
    before = model_file.read_bytes()
    for target in (foreign, link, model_file):
        rc, _, err = run_cli(["explain", str(tiny_run), "--prompt", "the", "--html", str(target)], capsys)
        assert assert_cli_error(rc, err, "explain") == (
            f"nanollama4 explain: error: --html {target} exists and is not a page nanollama4 explain wrote; pick a "
            "new file name (or pass --force to replace it)")
    assert foreign.read_text() == "<p>my notes</p>" and victim.read_text() == "keep me"
    assert model_file.read_bytes() == before
    page = tmp_path / "page.html"
    for _ in range(2):  # a page it wrote is replaced without asking
        rc, out, err = run_cli(["explain", str(tiny_run), "--prompt", "the", "--html", str(page)], capsys)
        assert rc == 0 and f"page: {page}" in out, err
    rc, out, err = run_cli(["explain", str(tiny_run), "--prompt", "the", "--html", str(link), "--force"], capsys)
    assert rc == 0, err
    assert not link.is_symlink() and victim.read_text() == "keep me"  # the link is replaced, not written through


# ---------------------------------------------------------------------------------------------- routing told truthfully
def _claim_slots(choice: list[list[float]], k: int, capacity: int) -> list[list[int]]:
    """Capacity assignment written out plainly, one token at a time: tokens in order of their best choice
    score (ties: earlier first) claim experts round by round, the r-th round offering each token still short
    of k its r-th ranked expert, which takes it while it has room."""
    T, E = len(choice), len(choice[0])
    ranked = [sorted(range(E), key=lambda e, t=t: (-choice[t][e], e)) for t in range(T)]
    order = sorted(range(T), key=lambda t: (-max(choice[t]), t))
    room, held = [capacity] * E, [[] for _ in range(T)]
    for r in range(E):
        for t in order:
            if len(held[t]) < k and room[ranked[t][r]] > 0:
                room[ranked[t][r]] -= 1
                held[t].append(ranked[t][r])
    return held


@pytest.mark.parametrize("case", ["sigmoid+bias", "tutorial-train"])
def test_the_trace_tells_each_routing_decision_as_an_independent_recomputation_finds_it(case):
    """From each MoE layer's input and its router's weights alone: logits, bias-added scores, top-k, weights
    and slot kinds, for the sigmoid router with a balancing bias (eval), and for the tutorial's router in
    train mode with noise and capacity acting (the noise is read from the trace: it is random)."""
    tok = CharTokenizer.from_text(TEXT)
    if case == "sigmoid+bias":
        cfg = nanollama4.preset("tiny", vocab_size=tok.vocab_size, bias_balance_rate=0.01)
    else:
        cfg = nanollama4.preset("tiny", vocab_size=tok.vocab_size, router="softmax", **{"softmax.noise": "learned"},
                                capacity_factor=0.5)
    torch.manual_seed(0)
    model = nanollama4.build_model(cfg)
    randomize_(model, seed=5)
    g = torch.Generator().manual_seed(6)
    for moe in model.moe_layers():
        moe.router.expert_bias.copy_(torch.randn(cfg.n_experts, generator=g) * 0.5 if case == "sigmoid+bias" else 0)
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m, args[0].detach().reshape(-1, 64)))
             for m in model.moe_layers()]
    t = trace(model, tok, "Facebook was founded", mode="eval" if case == "sigmoid+bias" else "train", seed=7)
    for h in hooks:
        h.remove()
    out = io.StringIO()
    show(t, Console(file=out, width=400, color_system=None))
    text = out.getvalue()
    k, changed, rerouted, dropped = cfg.experts_per_token, 0, 0, 0
    for layer in t.layers:
        moe = model.blocks[layer.index].ffn
        x = inputs[moe].double()
        logits = x @ moe.router.weight.double().T
        torch.testing.assert_close(layer.router_logits.double(), logits, atol=1e-4, rtol=1e-4)
        noise = torch.zeros_like(logits) if layer.noise is None else layer.noise.double()
        assert (layer.noise is None) == (case == "sigmoid+bias")
        bias = moe.router.expert_bias.double()
        if case == "sigmoid+bias":
            torch.testing.assert_close(layer.router_bias.double(), bias)
        else:
            assert layer.router_bias is None
        choice = logits + noise + bias
        torch.testing.assert_close(layer.choice_scores.double(), choice, atol=1e-4, rtol=1e-4)
        own = [sorted(range(cfg.n_experts), key=lambda e, c=c: -c[e])[:k] for c in choice.tolist()]
        if case == "sigmoid+bias":
            held = own
            weights = [[torch.sigmoid(logits[t_, e]).item() for e in row] for t_, row in enumerate(held)]
            changed += sum(r[0] != int(logits[t_].argmax()) for t_, r in enumerate(own))
        else:
            cap = math.ceil(cfg.capacity_factor * x.shape[0] * k / cfg.n_experts)
            held = _claim_slots(choice.tolist(), k, cap)
            scores = logits + noise
            weights = [(scores[t_, row].softmax(-1).tolist() if row else []) for t_, row in enumerate(held)]
        for t_ in range(x.shape[0]):
            got = [e for e in layer.experts[t_] if e >= 0]
            assert got == held[t_], (layer.index, t_)
            kept = [w for w, kind in zip(layer.weights[t_], layer.slot_kind[t_], strict=True) if kind != "dropped"]
            assert kept == pytest.approx(weights[t_], abs=1e-4)
            want_kinds = ["own" if e in own[t_] else "rerouted" for e in held[t_]] + ["dropped"] * (k - len(held[t_]))
            assert layer.slot_kind[t_] == want_kinds
            rerouted += want_kinds.count("rerouted")
            dropped += want_kinds.count("dropped")
        assert layer.rerouted == sum(kinds.count("rerouted") for kinds in layer.slot_kind)
        assert layer.dropped == sum(kinds.count("dropped") for kinds in layer.slot_kind)
        for token, line in zip(t.tokens, routing_lines(layer), strict=True):
            assert f"{token!r} → {line}" in text
    if case == "sigmoid+bias":
        assert changed > 0 and "balancing bias per expert" in text and "router's top logit: expert" in text
    else:
        assert rerouted > 0 and dropped > 0  # capacity really acted, both ways
        assert text.count("rerouted from expert") == rerouted and "pass: train mode" in text


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (.ci/run installs Debian's chromium)")
def test_the_page_shows_every_slot_and_marks_rerouted_and_dropped_ones(tmp_path):
    """A train-mode trace of the tutorial's router with capacity acting: every cell holds all K slots, and
    the rerouted and dropped ones are marked; chunk boundaries are drawn on a chunked layer's map."""
    tok = CharTokenizer.from_text(TEXT)
    cfg = nanollama4.preset("tiny", vocab_size=tok.vocab_size, router="softmax", **{"softmax.noise": "learned"},
                            capacity_factor=0.5)
    torch.manual_seed(0)
    model = nanollama4.build_model(cfg)
    randomize_(model, seed=5)
    t = trace(model, tok, TEXT[:24], mode="train", seed=3)
    page = tmp_path / "train.html"
    page.write_text(html(t), encoding="utf-8")
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert 'data-ready="yes"' in dom and 'data-clipped="0"' in dom  # every slot's text shown whole
    layer = next(lay for lay in t.layers if lay.experts is not None)  # the hover: the numbers the choice was made on
    e, w = layer.experts[0][0], layer.weights[0][0]
    assert (f"expert {e}: router logit {layer.router_logits[0, e]:.3f}, choice score "
            f"{layer.choice_scores[0, e]:.3f}, weight {w:.3f}") in dom.replace("&#10;", "\n")
    kinds = [k for layer in t.layers for row in layer.slot_kind for k in row]
    assert kinds.count("rerouted") > 0 and kinds.count("dropped") > 0
    assert dom.count('class="slot own"') == kinds.count("own")
    assert dom.count('class="slot rerouted"') == kinds.count("rerouted")
    assert dom.count('class="slot dropped"') == kinds.count("dropped")
    own = re.findall(r'class="slot own"[^>]*>([^<]*)<', dom)  # one notation for a slot, as the terminal writes it
    assert len(own) == kinds.count("own") and all(re.fullmatch(r"expert \d+ \(\d\.\d\d\)", s) for s in own)
    assert dom.count('class="chunk"') == 2 * ((24 - 1) // cfg.attention_chunk_size)  # layer 0: chunks of 8
    assert dom.count('<span style="background') >= cfg.n_experts  # the legend
    capped = [lay for lay in t.layers if lay.capacity is not None]  # each load chart's capacity line
    assert capped and dom.count('class="capacity"') == len(capped)
    for lay in capped:
        assert f'data-capacity="{lay.capacity}"' in dom and f"capacity {lay.capacity} (factor 0.5)" in dom
        assert max(sum(e == x for row in lay.experts for e in row) for x in range(cfg.n_experts)) <= lay.capacity
    shot = tmp_path / "train.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1200,1400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    assert matplotlib.image.imread(shot)[..., :3].std() > 0.05


def test_the_trace_tells_chunks_and_temperature_as_the_formulas_give_them():
    """Chunked layers: attention exactly zero across chunk boundaries, each query's first visible position
    its chunk's start. NoPE layers: the temperature per position is 1 + attn_scale * ln(1 + floor((p+1) /
    floor_scale)), computed here with math, and the terminal prints it."""
    tok = CharTokenizer.from_text(TEXT)
    cfg = nanollama4.preset("tiny", vocab_size=tok.vocab_size)  # chunks of 8, floor_scale 4, NoPE layer 3
    torch.manual_seed(0)
    model = nanollama4.build_model(cfg)
    randomize_(model, seed=2)
    t = trace(model, tok, TEXT[:30])
    out = io.StringIO()
    show(t, Console(file=out, width=400, color_system=None))
    text = out.getvalue()
    for layer in t.layers:
        if layer.kind == "rope":
            assert layer.chunk == 8 and layer.temperature is None
            assert layer.visible_from == [(p // 8) * 8 for p in range(30)]
            q, k = torch.meshgrid(torch.arange(30), torch.arange(30), indexing="ij")
            across = (q // 8 != k // 8) | (k > q)
            assert bool((layer.attention[:, across] == 0).all())
            assert bool((layer.attention[:, ~across] > 0).all())
        else:
            want = [1 + cfg.attn_scale * math.log(1 + math.floor((p + 1) / cfg.floor_scale)) for p in range(30)]
            assert layer.temperature == pytest.approx(want, abs=1e-6)
            assert len(set(round(x, 6) for x in layer.temperature)) > 3  # it varies within the prompt
            assert layer.visible_from == [0] * 30
            assert f"temperature (query scale) by position: 1.000 at 0-2, {want[3]:.3f} at 3-6" in text
    assert "chunked: a query sees only the earlier positions of its own chunk (0-7, 8-15, 16-23, 24-29)" in text


def test_one_tokens_path_through_each_block_adds_up():
    """The residual norms and sublayer contributions in the trace are those of the pass: captured here by
    hooks of our own, in = x, mid = x + attention, out = mid + FFN, FFN = routed + shared."""
    tok = CharTokenizer.from_text(TEXT)
    model = _model("sigmoid", tok.vocab_size)
    got: dict = {}
    hooks = []
    for i, block in enumerate(model.blocks):
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: got.__setitem__((i, "x"), a[0][0].clone())))
        hooks.append(block.attn.register_forward_hook(lambda m, a, o, i=i: got.__setitem__((i, "a"), o[0].clone())))
        hooks.append(block.ffn.register_forward_hook(lambda m, a, o, i=i: got.__setitem__((i, "f"), o[0].clone())))
    t = trace(model, tok, "Facebook was founded")
    for h in hooks:
        h.remove()
    for layer in t.layers:
        x, a, f = got[(layer.index, "x")], got[(layer.index, "a")], got[(layer.index, "f")]
        for name, want in (("residual_in", x), ("attention_added", a), ("residual_mid", x + a), ("ffn_added", f),
                           ("residual_out", x + a + f)):
            assert getattr(layer, name) == pytest.approx(want.norm(dim=-1).tolist(), rel=1e-5), name
        if layer.routed_added is not None:
            assert all(r + s >= total - 1e-5 for r, s, total in zip(layer.routed_added, layer.shared_added,
                                                                     layer.ffn_added, strict=True))
    out = io.StringIO()
    show(t, Console(file=out, width=400, color_system=None))
    assert out.getvalue().count("through the block: |x| ") == len(t.layers)
    assert "routed experts" in out.getvalue() and "shared expert" in out.getvalue()


def test_generation_is_told_pass_by_pass_as_generate_makes_it(tiny_run, capsys):
    """`explain --generate N`: a prefill, then one decode pass per token, the tokens greedy generation
    picks; chunked layers' caches hold at most chunk - 1 positions, the others every position so far."""
    from nanollama4.engine.generation import generate
    from nanollama4.explain import trace_generation
    from nanollama4.interop.checkpoint import load_run

    model, tok, _ = load_run(tiny_run)
    steps = trace_generation(model, tok, "the cat", 12)
    assert [s.kind for s in steps] == ["prefill"] + ["decode"] * 11
    assert "".join(s.chosen for s in steps) == generate(model, tok, "the cat", 12, temperature=0)
    for i, s in enumerate(steps):
        seen = 7 + i  # positions fed so far
        assert s.positions == ((0, 6) if i == 0 else (seen - 1, seen - 1))
        for layer, n in enumerate(s.cache_lengths):
            chunk = model.cfg.chunk_size(layer)
            assert n == (min(seen, chunk - 1) if chunk else seen), (i, layer)
        assert all(r is not None and len(r) == model.cfg.experts_per_token for r in s.routes)
        assert s.chosen == s.next_tokens[0][0]
    rc, out, err = run_cli(["explain", str(tiny_run), "--prompt", "the cat", "--generate", "3"], capsys)
    assert rc == 0, err
    assert "prefill: 7 prompt tokens at positions 0-6 in one pass" in out
    assert "decode 2: " in out and "KV cache per layer (positions held): layer 0 7" in out


def _shown(t) -> str:
    out = io.StringIO()
    show(t, Console(file=out, width=400, color_system=None))
    return out.getvalue()


def test_train_mode_names_exactly_what_acts_and_prints_the_capacity_it_computed():
    """The header lists the mechanisms this model has (none for a plain sigmoid router), and a layer with
    capacity prints ⌈cf·T·k/N⌉ as the pass computed it."""
    tok = CharTokenizer.from_text(TEXT)
    plain = _model("sigmoid", tok.vocab_size)
    text = _shown(trace(plain, tok, "Facebook was", mode="train", seed=0))
    assert "pass: train mode, as training runs it (this model has no router noise and no expert capacity" in text
    assert "capacity:" not in text and "router noise (" not in text

    torch.manual_seed(0)
    roomy = nanollama4.build_model(nanollama4.preset("tiny", vocab_size=tok.vocab_size, router="softmax",
                                                     **{"softmax.noise": "learned"}, capacity_factor=1.5)).eval()
    t = trace(roomy, tok, "Facebook was", mode="train", seed=0)
    text = _shown(t)
    T, k, n = len(t.tokens), roomy.cfg.experts_per_token, roomy.cfg.n_experts
    want = math.ceil(1.5 * T * k / n)
    assert want < T  # a real limit, not every token
    assert "router noise (learned); expert capacity (factor 1.5; a full expert's overflow to the next-best" in text
    moe_layers = [layer for layer in t.layers if layer.experts is not None]
    assert moe_layers and all(layer.capacity == want for layer in moe_layers)
    assert text.count(f"capacity: ⌈1.5 × {T} tokens × top-{k} / {n} experts⌉ = {want} slots per expert") == \
        len(moe_layers)
    assert "pass: eval mode, as generation runs it\n" in _shown(trace(roomy, tok, "Facebook was"))


def test_both_pages_draw_experts_in_the_one_palette_and_every_swatch_reads():
    """explain's page and the serve page take their colours from explain/palette.py (neither has colours of
    its own for experts), and black or white text on every expert's colour reaches WCAG's 4.5:1."""
    from importlib import resources

    from nanollama4.explain import palette
    from nanollama4.serve.api import _page

    for package in ("nanollama4.explain", "nanollama4.serve"):
        template = resources.files(package).joinpath("page.html").read_text(encoding="utf-8")
        assert palette.PLACEHOLDER in template, package
        assert "#F0E442" not in template and "hsl(" not in template, package  # no palette of its own
    colors = palette.expert_colors(128)
    assert len({c["bg"] for c in colors}) == 128
    assert min(palette.contrast(c["bg"], c["ink"]) for c in colors) >= 4.5
    assert palette.contrast(palette.DROPPED["bg"], palette.DROPPED["ink"]) >= 4.5
    assert palette.expert_colors(8)[6] == {"bg": "#F0E442", "ink": "#000000"}  # yellow: black text, not white

    tok = CharTokenizer.from_text(TEXT)
    model = _model("softmax", tok.vocab_size)
    want = json.dumps({"experts": palette.expert_colors(model.cfg.n_experts), "dropped": palette.DROPPED})
    assert want in html(trace(model, tok, "Facebook"))
    engine = SimpleNamespace(cfg=model.cfg, context=model.cfg.max_seq_len)
    assert want in _page(engine, "tiny")


def test_the_page_gets_values_as_computed_and_rounds_them_once_where_shown():
    """Weights, next-token odds, temperatures and the shared share go into the page unrounded (it rounds them
    as it shows them), so the page and the terminal round the same number once (0.7165 is not shown 0.717)."""
    tok = CharTokenizer.from_text(TEXT)
    model = _model("softmax", tok.vocab_size)
    t = trace(model, tok, "Facebook was")
    page = html(t)
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert data["next"] == [list(x) for x in t.next_tokens]
    moe = next(layer for layer in t.layers if layer.experts is not None)
    assert data["layers"][moe.index]["weights"] == moe.weights
    assert any(len(repr(w)) > 7 for row in moe.weights for w in row)  # more digits than any display shows


def test_piped_explain_never_wraps_a_line_and_counts_in_the_right_number(tiny_run):
    """Piped (no terminal), rich would cut every line at 80 columns: the --mode train header lost its "no",
    routes broke mid-slot. Now each line is whole, and a count of one is singular."""
    import sys

    long_prompt = "the cat sat on the mat and looked at the dog who did not look."
    out = subprocess.run([sys.executable, "-m", "nanollama4", "explain", str(tiny_run), "--prompt", long_prompt,
                          "--mode", "train", "--seed", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("pass: train mode") and lines[0].endswith(")")  # the header whole
    through = [x for x in lines if "through the block" in x]
    assert through and all(re.search(r"\|x\| [\d.]+ -> .* = [\d.]+$", x) for x in through)
    routes = [x.split(" → ", 1)[1].split("   [")[0] for x in lines if " → " in x]
    slot = r"expert \d+ \(\d\.\d\d(, rerouted from expert \d+: full)?\)|dropped \(no expert had room\)"
    assert routes and all(re.fullmatch(rf"({slot})(, ({slot}))*", r) for r in routes)
    assert max(map(len, lines)) > 80  # long lines exist, and stayed long


def test_plural_counts():
    from nanollama4.explain.terminal import plural, slot_text

    assert (plural(1, "slot"), plural(0, "slot"), plural(2, "slot")) == ("1 slot", "0 slots", "2 slots")
    assert slot_text(2, 0.555) == "expert 2 (0.56)"


def test_norms_print_the_means_the_trace_holds_and_untrained_is_the_fresh_model(tiny_run, capsys):
    from nanollama4.interop.checkpoint import load_run
    from nanollama4.ops import build_model

    prompt = "the cat sat"
    rc, trained, _ = run_cli(["explain", str(tiny_run), "--prompt", prompt, "--norms"], capsys)
    rc2, fresh, _ = run_cli(["explain", str(tiny_run), "--prompt", prompt, "--norms", "--untrained", "--seed", "3"],
                            capsys)
    assert rc == rc2 == 0 and trained != fresh
    model, tok, _ = load_run(tiny_run)
    torch.manual_seed(3)
    for text, m in ((trained, model), (fresh, build_model(model.cfg))):
        t = trace(m, tok, prompt)
        rows = [line.split("│") for line in text.splitlines() if re.match(r"^ \d+ +│", line)]
        assert len(rows) == len(t.layers)
        for row, layer in zip(rows, t.layers, strict=True):
            assert float(row[1]) == pytest.approx(sum(layer.residual_in) / len(t.tokens), rel=6e-3)
            assert float(row[5]) == pytest.approx(sum(layer.routed_added) / len(t.tokens), rel=6e-3)
            assert row[7].strip() == f"{layer.shared_share:.0%}"
