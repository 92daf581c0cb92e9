"""Explain mode: walk one prompt through the model and keep what each layer did.

  explain.tracing   `trace(model, tokenizer, prompt)` -> `Trace`: one eval pass with observers attached
                    from outside (shapes, attention probabilities, routing), removed again afterwards
  explain.terminal  `show(trace)`: the trace as rich tables
  explain.page      `html(trace)`: one self-contained offline page, its markup and script in page.html;
                    in a notebook a Trace shows itself as that page (`notebook_html`)

  explain.palette   the colours the page and the experts page share

The views only read a `Trace`; tracing.py imports neither of them.

A whole text's routing (`nanollama4 experts`) is reports/'s: this folder is one prompt.
"""

from .page import PAGE_SCORES_LIMIT, html, notebook_html
from .terminal import routing_lines, show, show_generation, show_norms
from .tracing import TOP_NEXT, GenerationStep, LayerTrace, Trace, describe_attention, trace, trace_generation

__all__ = ["trace", "Trace", "LayerTrace", "TOP_NEXT", "describe_attention", "show", "routing_lines", "html",
           "PAGE_SCORES_LIMIT", "trace_generation", "GenerationStep", "show_generation", "show_norms"]

# A Trace shows itself as the page in a notebook. Attached here, where both modules are known, because
# tracing.py imports none of its views.
Trace._repr_html_ = notebook_html
