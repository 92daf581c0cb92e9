"""Explain mode: walk one prompt through the model and keep what each layer did.

`trace(model, tokenizer, prompt)` runs one eval forward pass with observers attached from outside: a
forward hook on every module (shapes), a recording attention backend in every `Attention.attend` (the
probabilities the layer attended with), and a recorder around each MoE layer's `route` (the decision
its experts were given) with its shared expert's output. Every number in the `Trace` comes from that
pass. The observers are removed afterwards and every module's train/eval mode is restored; each MoE
layer's `stats` then describe this pass. `show` prints a trace with rich tables.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import Attention, attention_mask
from .errors import GenerationError
from .model import Transformer
from .moe import MoE
from .tokenizer import Tokenizer

TOP_NEXT = 10  # next tokens listed


@dataclass
class LayerTrace:
    """One block of the pass."""

    index: int
    kind: str  # "rope" (rotary positions, QK-norm, maybe chunked) or "nope" (no positions, temperature)
    chunk: int | None  # chunked-attention block size; None = full causal attention
    qk_norm: bool
    temperature: bool  # NoPE query scaling with position
    q_shape: tuple[int, ...]  # (B, T, query heads, head dim)
    k_shape: tuple[int, ...]  # (B, T, KV heads, head dim)
    v_shape: tuple[int, ...]
    attention: torch.Tensor  # (heads, T, T) probabilities of the first (only) sequence, float32
    n_experts: int | None = None  # routed experts in the layer (MoE layers; None for dense)
    experts: list[list[int]] | None = None  # per token, its routed experts (MoE layers; None for dense)
    weights: list[list[float]] | None = None  # per token, the router weight of each of those experts
    rerouted: int | None = None  # assignments that went past a token's top-k because an expert was full
    dropped: int | None = None  # slots that found no expert with room
    shared_share: float | None = None  # |shared expert's output| / |MoE layer's output|, mean over tokens

    @property
    def gqa(self) -> str:
        return f"{self.q_shape[2]} query heads share {self.k_shape[2]} KV heads"


@dataclass
class Trace:
    """What one prompt did in the model."""

    tokens: list[str]  # each token's text
    ids: list[int]
    embedding_shape: tuple[int, ...]  # (1, T, d_model)
    layers: list[LayerTrace]
    next_tokens: list[tuple[str, float]]  # the most likely next tokens after the last position
    modules: list[tuple[str, list[tuple[int, ...]], tuple[int, ...]]] = field(default_factory=list)
    # every module call in order: (name, input shapes, output shape)


def trace(model: Transformer, tokenizer: Tokenizer, prompt: str) -> Trace:
    """Run `prompt` through `model` once (eval, no gradient) and return what each layer did."""
    if not prompt:
        raise GenerationError("the prompt is empty; give some text to explain")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise GenerationError("the prompt encodes to no tokens; give some text to explain")
    limit = model.cfg.max_seq_len
    if len(ids) > limit:
        raise GenerationError(f"the prompt is {len(ids)} tokens, more than the model's max_seq_len ({limit}); "
                              "shorten it")
    modes = {m: m.training for m in model.modules()}
    model.eval()
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    try:
        with torch.no_grad(), _observed(model) as seen:
            logits = model(x)
    finally:
        for m, training in modes.items():
            m.training = training
    if not bool(torch.isfinite(logits).all()):
        raise GenerationError("the model's output is not finite for this prompt; the weights may have diverged")
    probs = logits[0, -1].float().softmax(-1)
    top = probs.topk(min(TOP_NEXT, probs.numel()))
    next_tokens = [(tokenizer.decode([int(i)]), float(p)) for p, i in zip(top.values, top.indices, strict=True)]
    layers = [_layer_trace(i, block, seen) for i, block in enumerate(model.blocks)]
    return Trace(tokens=[tokenizer.decode([i]) for i in ids], ids=list(ids), embedding_shape=seen["embed"],
                 layers=layers, next_tokens=next_tokens, modules=seen["modules"])


@contextmanager
def _observed(model: Transformer) -> Iterator[dict]:
    """Attach the observers for one pass; `seen` fills in as the pass runs."""
    seen: dict = {"modules": [], "attention": {}, "qkv": {}, "shared": {}, "moe_out": {}, "routing": {},
                  "embed": None}
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def shapes(values) -> list[tuple[int, ...]]:
        return [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]

    def any_module(module, inputs, output) -> None:
        outs = shapes([output] if isinstance(output, torch.Tensor) else
                      output if isinstance(output, (tuple, list)) else [])
        seen["modules"].append((names[module] or "model", shapes(inputs), outs[0] if outs else ()))

    for module in model.modules():
        handles.append(module.register_forward_hook(any_module))
    handles.append(model.embed.register_forward_hook(
        lambda m, i, o: seen.__setitem__("embed", tuple(o.shape))))
    originals = {}
    for module in model.modules():
        if isinstance(module, Attention):
            originals[module] = module.attend
            module.attend = _recording(module, module.attend, seen)
        if isinstance(module, MoE):
            originals[module] = vars(module).get("route")  # an instance-level route of its own, if any
            module.route = _routing_recorder(module, module.route, seen)  # wraps whichever route it had
            handles.append(module.register_forward_hook(
                lambda m, i, o: seen["moe_out"].__setitem__(m, o.detach().float().reshape(-1, o.shape[-1]))))
            if module.shared_expert is not None:
                handles.append(module.shared_expert.register_forward_hook(
                    lambda m, i, o, moe=module: seen["shared"].__setitem__(moe, o.detach().float())))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
        for module, original in originals.items():
            if isinstance(module, Attention):
                module.attend = original  # its own attribute, put back
            elif original is not None:
                module.route = original
            else:
                del module.route  # the recorder shadowed the class's method


def _recording(attn: Attention, attend, seen: dict):
    """An attention backend that keeps the probabilities it attends with, then returns the layer's output."""

    def record(q, k, v, q_pos, k_pos, chunk, mask):
        seen["qkv"][attn] = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        with torch.autocast(q.device.type, enabled=False):  # the probabilities, from the same q and k
            allowed = attention_mask(q_pos, k_pos, chunk) if mask is None else mask
            rep = q.shape[2] // k.shape[2]
            k_rep = k.float().repeat_interleave(rep, dim=2)  # (B, Tk, H, Dh): query head h reads KV head h // rep
            scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k_rep) / math.sqrt(q.shape[-1])
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)  # (B, H, Tq, Tk)
        seen["attention"][attn] = probs[0].cpu()
        return attend(q, k, v, q_pos, k_pos, chunk, mask)  # the layer's output, as the real backend makes it

    return record


def _routing_recorder(moe: MoE, route, seen: dict):
    """MoE.route, keeping the decision it returns."""

    def record(x_TD):
        seen["routing"][moe] = decision = route(x_TD)
        return decision

    return record


def _layer_trace(i: int, block: nn.Module, seen: dict) -> LayerTrace:
    attn = block.attn
    q_shape, k_shape, v_shape = seen["qkv"][attn]
    layer = LayerTrace(index=i, kind="rope" if attn.use_rope else "nope", chunk=attn.chunk, qk_norm=attn.qk_norm,
                       temperature=attn.temperature, q_shape=q_shape, k_shape=k_shape, v_shape=v_shape,
                       attention=seen["attention"][attn])
    moe = block.ffn
    if isinstance(moe, MoE):
        r = seen["routing"][moe]
        valid = torch.ones_like(r.experts_TK, dtype=torch.bool) if r.valid_TK is None else r.valid_TK
        layer.experts = [[e for e, ok in zip(row, oks, strict=True) if ok]
                         for row, oks in zip(r.experts_TK.tolist(), valid.tolist(), strict=True)]
        layer.weights = [[w for w, ok in zip(row, oks, strict=True) if ok]
                         for row, oks in zip(r.weights_TK.tolist(), valid.tolist(), strict=True)]
        layer.rerouted, layer.dropped, layer.n_experts = int(r.rerouted), int(r.dropped), moe.n_experts
        if moe in seen["shared"]:
            shared_TD, out_TD = seen["shared"][moe], seen["moe_out"][moe]
            layer.shared_share = float((shared_TD.norm(dim=-1) / out_TD.norm(dim=-1).clamp_min(1e-12)).mean())
    return layer


# ---------------------------------------------------------------------------------------------- the terminal
def show(t: Trace, console=None, modules: bool = False) -> None:
    """Print a trace with rich tables, in the order the pass ran: tokens, embedding, each layer, next tokens.
    `modules` adds every module call's input and output shapes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    console.print("tokens:")
    tokens = Table(show_edge=False)
    for name in ("position", "token", "id"):
        tokens.add_column(name)
    for p, (tok, i) in enumerate(zip(t.tokens, t.ids, strict=True)):
        tokens.add_row(str(p), escape(repr(tok)), str(i))
    console.print(tokens)
    console.print(f"embedding: ids {(1, len(t.ids))} -> {t.embedding_shape}", markup=False)
    for layer in t.layers:
        console.print()
        console.print(f"[bold]layer {layer.index}[/bold]: {describe_attention(layer)}")
        console.print(f"  q {layer.q_shape}, k {layer.k_shape}, v {layer.v_shape}: {layer.gqa}", markup=False)
        if layer.experts is None:
            console.print("  feed-forward: dense SwiGLU")
            continue
        console.print("  routed experts, with the router's weight:")
        for tok, line in zip(t.tokens, routing_lines(layer), strict=True):
            console.print(f"    {tok!r} → {line}", markup=False, highlight=False)
        shared = "none" if layer.shared_share is None else \
            f"always on, {layer.shared_share:.0%} of the layer's output norm on average"
        console.print(f"  shared expert: {shared}; rerouted {layer.rerouted}, dropped {layer.dropped}", markup=False)
    nxt = Table(show_edge=False)
    nxt.add_column("token")
    nxt.add_column("probability", justify="right")
    for tok, p in t.next_tokens:
        nxt.add_row(escape(repr(tok)), f"{p:.1%}")
    console.print()
    console.print("next token after the prompt:")
    console.print(nxt)
    if modules:
        console.print("every module call, in order:")
        calls = Table(show_edge=False)
        for name in ("module", "inputs", "output"):
            calls.add_column(name)
        for name, ins, out in t.modules:
            calls.add_row(escape(name), ", ".join(str(s) for s in ins), str(out))
        console.print(calls)


def describe_attention(layer: LayerTrace) -> str:
    if layer.kind == "rope":
        extent = f"chunked attention (blocks of {layer.chunk})" if layer.chunk else "full causal attention"
        return f"RoPE + {extent}{' + QK-norm' if layer.qk_norm else ''}"
    return f"NoPE + full causal attention{' + temperature tuning' if layer.temperature else ''}"


def routing_lines(layer: LayerTrace) -> list[str]:
    """Per token: "expert 1 (0.70), expert 3 (0.30)" (or "no expert had room")."""
    assert layer.experts is not None and layer.weights is not None
    return [", ".join(f"expert {e} ({w:.2f})" for e, w in zip(experts, weights, strict=True)) or "no expert had room"
            for experts, weights in zip(layer.experts, layer.weights, strict=True)]


# ---------------------------------------------------------------------------------------------- the page
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
        "next": [[tok, round(p, 4)] for tok, p in t.next_tokens],
        "layers": [{
            "index": layer.index, "kind": describe_attention(layer), "gqa": layer.gqa,
            "q": list(layer.q_shape), "k": list(layer.k_shape), "v": list(layer.v_shape),
            "experts": layer.experts, "n_experts": layer.n_experts,
            "weights": None if layer.weights is None else [[round(w, 3) for w in row] for row in layer.weights],
            "rerouted": layer.rerouted, "dropped": layer.dropped,
            "shared": None if layer.shared_share is None else round(layer.shared_share, 3),
            "attention": [[[None if p == 0 else round(p, 4) for p in row] for row in head]
                          for head in layer.attention.tolist()],
        } for layer in t.layers],
    }
    # inside <script>, no "<", ">" or "&" may appear raw: token text such as "</script>" or "<!--" would end
    # or change the script element; JSON's \u escapes say the same characters safely
    payload = (json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
               .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))
    fills = {"TITLE": escape_html(title), "DATA": payload}
    return re.sub(r"@(TITLE|DATA)@", lambda m: fills[m[1]], _PAGE)  # one pass: a prompt is never re-read


def escape_html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>@TITLE@</title>
<style>
body{font:14px system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px} h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse} td,th{padding:2px 6px;text-align:left}
td.cell{width:42px;height:20px;text-align:center;font-size:11px;color:#fff;border:1px solid #fff}
.muted{color:#777} select{margin-right:12px}
</style></head><body>
<h1>@TITLE@</h1>
<p id="shape" class="muted"></p>
<h2>Routing: each token's top expert per MoE layer (hover for all experts and weights)</h2>
<table id="grid"></table>
<h2>Expert load per MoE layer (assignments per expert)</h2>
<div id="load"></div>
<h2>Attention</h2>
<label>layer <select id="layer"></select></label><label>head <select id="head"></select></label>
<div id="attention"></div>
<h2>Next token</h2>
<table id="next"></table>
<script id="data" type="application/json">@DATA@</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const SVG = "http://www.w3.org/2000/svg";  // the SVG namespace: a name, never fetched
function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function color(expert) { return "hsl(" + ((expert * 137.5) % 360) + ",60%,45%)"; }
const moe = D.layers.filter(l => l.experts);
function ffn(l) {
  if (!l.experts) return ", dense SwiGLU";
  if (l.shared === null) return ", MoE";
  return ", MoE + shared expert (" + Math.round(100 * l.shared) + "% of the output norm)";
}
document.getElementById("shape").textContent = D.tokens.length + " tokens, embedding " +
  JSON.stringify(D.embedding) + "; " +
  D.layers.map(l => "layer " + l.index + ": " + l.kind + ", " + l.gqa + ffn(l)).join("; ");
const grid = document.getElementById("grid");
const head = el("tr"); head.appendChild(el("th", {}, "token"));
for (const l of moe) head.appendChild(el("th", {}, "layer " + l.index));
grid.appendChild(head);
D.tokens.forEach((tok, t) => {
  const row = el("tr"); row.appendChild(el("td", {}, JSON.stringify(tok)));
  for (const l of moe) {
    const ex = l.experts[t], w = l.weights[t];
    const cell = el("td", {class: "cell", "data-layer": l.index, "data-token": t,
      title: ex.map((e, j) => "expert " + e + " (" + w[j].toFixed(2) + ")").join(", ") || "no expert had room"},
      ex.length ? String(ex[0]) : "-");
    if (ex.length) cell.style.background = color(ex[0]); else cell.style.background = "#999";
    row.appendChild(cell);
  }
  grid.appendChild(row);
});
const load = document.getElementById("load");
for (const l of moe) {
  const counts = {};
  l.experts.flat().forEach(e => { counts[e] = (counts[e] || 0) + 1; });
  const n = l.n_experts, top = Math.max(1, ...Object.values(counts));
  const svg = el("svg:svg", {width: 40 + 28 * n, height: 120, "data-layer": l.index});
  svg.appendChild(el("svg:text", {x: 0, y: 14}, "layer " + l.index));
  for (let e = 0; e < n; e++) {
    const h = 80 * (counts[e] || 0) / top;
    svg.appendChild(el("svg:rect", {x: 40 + 28 * e, y: 100 - h, width: 22, height: h, fill: color(e)}));
    svg.appendChild(el("svg:text", {x: 44 + 28 * e, y: 116, "font-size": 11}, String(e)));
  }
  load.appendChild(svg);
}
const layerSel = document.getElementById("layer"), headSel = document.getElementById("head");
D.layers.forEach(l => layerSel.appendChild(el("option", {value: l.index}, String(l.index))));
for (let h = 0; h < D.layers[0].attention.length; h++) headSel.appendChild(el("option", {value: h}, String(h)));
function drawAttention() {
  const a = D.layers[+layerSel.value].attention[+headSel.value], n = a.length, s = Math.max(4, Math.min(24, 480 / n));
  const svg = el("svg:svg", {width: n * s + 2, height: n * s + 2, id: "heatmap"});
  a.forEach((row, q) => row.forEach((p, k) => {
    if (p !== null) svg.appendChild(el("svg:rect", {x: k * s, y: q * s, width: s, height: s,
      fill: "rgba(200,60,40," + Math.min(1, 0.08 + p) + ")"}, undefined));
  }));
  const box = document.getElementById("attention"); box.replaceChildren(svg);
}
layerSel.onchange = headSel.onchange = drawAttention; drawAttention();
const next = document.getElementById("next");
next.appendChild(el("tr")).append(el("th", {}, "token"), el("th", {}, "probability"));
D.next.forEach(([tok, p]) => next.appendChild(el("tr")).append(el("td", {}, JSON.stringify(tok)),
  el("td", {}, (100 * p).toFixed(1) + "%")));
document.body.setAttribute("data-ready", "yes");
</script></body></html>
"""
