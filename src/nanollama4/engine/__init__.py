"""One inference engine behind `generate`, `stream`, `explain --generate` and `serve`.

  engine.core      Engine (the scheduler and one `step()`), Request, TokenEvent, Finished
  engine.cache     SlotCache: the KV cache of the engine's rows (ring slots for chunked layers)
  engine.runner    Runner: the prefill and the batched decode pass (compiled where it pays)
  engine.sampling  Sampling (the one contract for sampling values), next_token, TextStream (stops)

Offline generation is "add the prompts, step until done" (`generation.generate`); the server runs the
same engine on a thread of its own (`serve.engine`). See docs/reference.md for the picture of a step.
"""

from .cache import SlotCache, check_cache_fits
from .core import Engine, Event, Finished, Request, TokenEvent
from .sampling import GREEDY_BELOW, Sampling, SamplingError, TextStream, filter_logits, next_token

__all__ = ["Engine", "Request", "TokenEvent", "Finished", "Event", "SlotCache", "check_cache_fits", "Sampling",
           "SamplingError", "TextStream", "filter_logits", "next_token", "GREEDY_BELOW"]
