"""The terminal view of a trace: rich tables, in the order the pass ran.

A routed slot reads "expert 2 (0.56)" here, on both pages and in the docs (`slot_text`): the expert, then
the router weight it got; a rerouted one adds where it came from inside the brackets, "expert 3 (0.30,
rerouted from expert 5: full)".
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .tracing import GenerationStep, LayerTrace, Trace, describe_attention

if TYPE_CHECKING:
    from rich.console import Console


def slot_text(expert: int, weight: float) -> str:
    """One routed slot, as every view writes it: "expert 2 (0.56)"."""
    return f"expert {expert} ({weight:.2f})"


def plural(n: int, word: str) -> str:
    """"1 slot", "2 slots"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def terminal_console() -> Console:
    """A rich Console as wide as the terminal; piped or redirected, one that never wraps a line (rich would
    otherwise cut every line at 80 columns, mid-sentence and mid-route)."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console()
    return Console(width=100_000, soft_wrap=True)


def show(t: Trace, console: Console | None = None, modules: bool = False) -> None:
    """Print a trace with rich tables, in the order the pass ran: tokens, embedding, each layer, next tokens.
    `modules` adds every module call's input and output shapes."""
    from rich.markup import escape
    from rich.table import Table

    console = console or terminal_console()
    if t.mode == "eval":
        header = "pass: eval mode, as generation runs it"
        if t.acting:
            header += f" ({'; '.join(t.acting)} acts here too)"
    elif t.acting:
        header = f"pass: train mode, as training runs it ({'; '.join(t.acting)}; seed {t.seed})"
    else:
        header = ("pass: train mode, as training runs it (this model has no router noise and no expert capacity, "
                  "so the routing is the eval pass's)")
    console.print(header, markup=False)
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
        for line in attention_lines(layer):
            console.print(f"  {line}", markup=False, highlight=False)
        console.print(f"  {path_line(layer, t.tokens)}", markup=False, highlight=False)
        if layer.experts is None:
            console.print("  feed-forward: dense SwiGLU")
            continue
        for line in router_summary(layer):
            console.print(f"  {line}", markup=False, highlight=False)
        console.print("  routed experts, with their weights:")
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


def routing_lines(layer: LayerTrace) -> list[str]:
    """Per token its slots, e.g. "expert 1 (0.70), expert 3 (0.30, rerouted from expert 5: full)", and when
    the chosen expert is not the router's top logit, which one that was and what moved the choice."""
    assert layer.experts is not None and layer.weights is not None and layer.slot_kind is not None
    lines = []
    changed = layer.bias_changed or [False] * len(layer.experts)
    for t, (experts, weights, kinds, froms) in enumerate(zip(layer.experts, layer.weights, layer.slot_kind,
                                                              layer.rerouted_from or [], strict=True)):
        parts = []
        for e, w, kind, source in zip(experts, weights, kinds, froms, strict=True):
            if kind == "dropped":
                parts.append("dropped (no expert had room)")
            elif kind == "rerouted":
                parts.append(f"expert {e} ({w:.2f}, rerouted from expert {source}: full)")
            else:
                parts.append(slot_text(e, w))
        line = ", ".join(parts)
        if changed[t]:
            top = int(layer.router_logits[t].argmax())
            what = " + ".join(n for n, v in (("noise", layer.noise), ("bias", layer.router_bias)) if v is not None)
            first = int(layer.choice_scores[t].argmax())
            line += (f"   [router's top logit: expert {top} ({layer.router_logits[t, top]:+.2f}) over expert {first} "
                     f"({layer.router_logits[t, first]:+.2f}); {what or 'the scores'} chose expert {first}]")
        lines.append(line)
    return lines


def router_summary(layer: LayerTrace) -> list[str]:
    """How this layer's router chose, in a few lines: what the top-k was taken on and what acted."""
    K = len(layer.experts[0]) if layer.experts else 0
    parts = ["router logits"]
    if layer.noise is not None:
        parts.append("noise (training)")
    if layer.router_bias is not None:
        parts.append("balancing bias")
    lines = [f"top-{K} of {layer.n_experts} experts, taken on {' + '.join(parts)}"]
    if layer.router_bias is not None:
        bias = " ".join(f"{b:+.2f}" for b in layer.router_bias.tolist())
        before_bias = layer.choice_scores - layer.router_bias
        moved = int((before_bias.argmax(-1) != layer.choice_scores.argmax(-1)).sum())
        lines.append(f"balancing bias per expert (auxiliary-loss-free, as in DeepSeek-V3; added for the choice "
                     f"only, never to the weights): {bias}; it moved {moved} of {len(layer.experts)} tokens' first "
                     "expert")
    if layer.capacity is not None:
        T, K = len(layer.experts), len(layer.experts[0]) if layer.experts else 0
        lines.append(f"capacity: ⌈{layer.capacity_factor:g} × {T} tokens × top-{K} / {layer.n_experts} experts⌉ = "
                     f"{plural(layer.capacity, 'slot')} per expert; {plural(layer.rerouted, 'slot')} rerouted to a "
                     f"next-best expert, {layer.dropped} dropped")
    return lines


def attention_lines(layer: LayerTrace) -> list[str]:
    """What each query could see, and on NoPE layers the temperature by position, as runs of positions."""
    T = len(layer.visible_from)
    lines = []
    if layer.chunk and T > layer.chunk:
        spans = ", ".join(f"{s}-{min(s + layer.chunk, T) - 1}" for s in range(0, T, layer.chunk))
        lines.append(f"chunked: a query sees only the earlier positions of its own chunk ({spans})")
    elif layer.chunk:
        lines.append(f"chunked by {layer.chunk}, but all {T} positions fall in the first chunk: full causal here")
    if layer.temperature is not None:
        runs, start = [], 0
        for p in range(1, T + 1):
            if p == T or layer.temperature[p] != layer.temperature[start]:
                runs.append(f"{layer.temperature[start]:.3f} at {start}-{p - 1}" if p - 1 > start else
                            f"{layer.temperature[start]:.3f} at {start}")
                start = p
        lines.append(f"temperature (query scale) by position: {', '.join(runs)}")
    return lines


def path_line(layer: LayerTrace, tokens: list[str], position: int = -1) -> str:
    """One token's way through the block: the residual stream's norm, and what each sublayer added to it
    (its norm, and as a share of the stream it was added to), the routed and shared parts of an MoE."""
    p = position % len(tokens)
    x, a, mid, f, out = (layer.residual_in[p], layer.attention_added[p], layer.residual_mid[p], layer.ffn_added[p],
                         layer.residual_out[p])
    parts = ""
    if layer.routed_added is not None and layer.shared_added is not None:
        parts = f": routed experts {layer.routed_added[p]:.2f}, shared expert {layer.shared_added[p]:.2f}"
    return (f"token {p} {tokens[p]!r} through the block: |x| {x:.2f} -> + attention |{a:.2f}| "
            f"({a / max(x, 1e-12):.0%} of |x|) = {mid:.2f} -> + feed-forward |{f:.2f}| ({f / max(mid, 1e-12):.0%}"
            f"{parts}) = {out:.2f}")


def show_norms(t: Trace, console: Console | None = None) -> None:
    """The residual stream through each block, as means over the prompt's tokens: its norm coming in (and the
    range over tokens), what attention and the feed-forward add, the routed and shared experts' parts, and
    the shared expert's share of the feed-forward's output norm (`LayerTrace.shared_share`)."""
    from rich.table import Table

    console = console or terminal_console()
    n = len(t.tokens)
    console.print(f"the residual stream through each block, means over the prompt's {plural(n, 'token')} (|v| is "
                  "the L2 norm of one token's vector):", markup=False)
    table = Table(show_edge=False)
    for name in ("layer", "|x| in", "|x| in, min-max", "+ attention", "+ feed-forward", "routed experts",
                 "shared expert", "shared share"):
        table.add_column(name, justify="left" if name == "layer" else "right")
    for layer in t.layers:
        moe = layer.routed_added is not None and layer.shared_added is not None
        table.add_row(str(layer.index), _mean(layer.residual_in),
                      f"{min(layer.residual_in):.3g}-{max(layer.residual_in):.3g}",
                      _mean(layer.attention_added), _mean(layer.ffn_added),
                      _mean(layer.routed_added) if moe else "-", _mean(layer.shared_added) if moe else "-",
                      f"{layer.shared_share:.0%}" if layer.shared_share is not None else "-")
    console.print(table)


def _mean(values: list[float] | None) -> str:
    """The mean to 3 significant digits: a stream of 0.3 and one of 130 both keep their detail."""
    return f"{sum(values) / len(values):.3g}" if values else "-"


def show_generation(steps: list[GenerationStep], console: Console | None = None) -> None:
    """Print generation pass by pass: what was fed (the prompt at once, then one token), how much each
    layer's KV cache holds, the fed token's route through every MoE layer, and the odds it chose from."""
    console = console or terminal_console()
    console.print(f"generation, greedy: {len(steps)} new tokens, one forward pass each", markup=False)
    for i, s in enumerate(steps):
        first, last = s.positions
        what = (f"prefill: {len(s.fed)} prompt tokens at positions {first}-{last} in one pass" if s.kind == "prefill"
                else f"decode {i}: {s.fed[0]!r} at position {first}, attending to the cache")
        console.print(what, markup=False, highlight=False)
        console.print("  KV cache per layer (positions held): " + ", ".join(
            f"layer {j} {n}" for j, n in enumerate(s.cache_lengths)), markup=False, highlight=False)
        routes = [f"layer {j}: " + (", ".join(slot_text(e, w) for e, w in r) or "no expert had room")
                  for j, r in enumerate(s.routes) if r is not None]
        if routes:
            console.print(f"  route of {s.fed[-1]!r}: " + "; ".join(routes), markup=False, highlight=False)
        odds = ", ".join(f"{tok!r} {p:.1%}" for tok, p in s.next_tokens[:5])
        console.print(f"  next: {odds} -> {s.chosen!r}", markup=False, highlight=False)
