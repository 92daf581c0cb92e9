"""Explain mode: walk one prompt through the model and keep what each layer did.

  explain.tracing   `trace(model, tokenizer, prompt)` -> `Trace`: one eval pass with observers attached
                    from outside (shapes, attention probabilities, routing), removed again afterwards
  explain.terminal  `show(trace)`: the trace as rich tables
  explain.page      `html(trace)`: one self-contained offline page, its markup and script in page.html;
                    in a notebook a Trace shows itself as that page (`notebook_html`)

The views only read a `Trace`; tracing.py imports neither of them.

Over a whole text rather than one prompt (`nanollama4 experts`), imported from their modules:
  explain.routes       `route_stream(model, ids)` -> `Routes`: every token's slots per MoE layer, in windows
  explain.experts      `experts(model, tokenizer, ids)` -> `ExpertsReport`: loads, lift, classes, MI, paths
  explain.specialise   the arithmetic: lift, mutual information, the shuffle null, intervals
  explain.expertsview  `show_experts(report)`, `write_json(report, path)`
  explain.expertspage  `experts_html(report)`: the offline page (experts.html), filled and written as page.py's
"""

from .page import PAGE_SCORES_LIMIT, html, notebook_html
from .terminal import routing_lines, show, show_generation, show_norms
from .tracing import TOP_NEXT, GenerationStep, LayerTrace, Trace, describe_attention, trace, trace_generation

__all__ = ["trace", "Trace", "LayerTrace", "TOP_NEXT", "describe_attention", "show", "routing_lines", "html",
           "PAGE_SCORES_LIMIT", "trace_generation", "GenerationStep", "show_generation", "show_norms"]

# A Trace shows itself as the page in a notebook. Attached here, where both modules are known, because
# tracing.py imports none of its views.
Trace._repr_html_ = notebook_html
