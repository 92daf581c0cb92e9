"""The terminal view of a trace: rich tables, in the order the pass ran."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .tracing import LayerTrace, Trace, describe_attention

if TYPE_CHECKING:
    from rich.console import Console


def show(t: Trace, console: Console | None = None, modules: bool = False) -> None:
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


def routing_lines(layer: LayerTrace) -> list[str]:
    """Per token: "expert 1 (0.70), expert 3 (0.30)" (or "no expert had room")."""
    assert layer.experts is not None and layer.weights is not None
    return [", ".join(f"expert {e} ({w:.2f})" for e, w in zip(experts, weights, strict=True)) or "no expert had room"
            for experts, weights in zip(layer.experts, layer.weights, strict=True)]
