"""One inference engine behind `generate`, `stream`, `explain --generate` and `serve`.

  engine.request    Request, TokenEvent, Finished: what goes in and what comes out
  engine.scheduler  Scheduler: which requests wait, which rows are free, how much of a prompt a step feeds
  engine.core       Engine: one `step()` (prefill, decode, choose, retire) over the scheduler's rows
  engine.cache      SlotCache: the KV cache of the engine's rows (ring slots for chunked layers)
  engine.runner     Runner: the prefill and the batched decode pass (compiled where it pays)
  engine.graphs     the decode step captured once per batch size and replayed (CUDA graphs)
  engine.sampling   Sampling (the one contract for sampling values), next_token (the one choice), TextStream
  engine.trace      StepTrace, StepObserver: a traced step, built only when a request asks for it
  engine.observe    observers attached from outside a model: what each layer attended with and routed to
  engine.generation generate, stream: "add the prompts, step until done"; `sample`, the plain reference loop

Offline generation is "add the prompts, step until done" (`generation.generate`); the server runs the
same engine on a thread of its own (`serve.engine`). See docs/reference.md for the picture of a step.
"""

import importlib
from typing import Any

# Names load on first use (PEP 562), so that reading `engine.sampling.Sampling` (the command line builds its
# flags from it) does not import torch through the engine's other modules.
_HOMES = {"Engine": "core", "Request": "request", "TokenEvent": "request", "Finished": "request",
          "Event": "request", "Scheduler": "scheduler", "QueueFull": "scheduler", "StepTrace": "trace",
          "StepObserver": "trace", "SlotCache": "cache", "check_cache_fits": "cache", "Sampling": "sampling",
          "SamplingError": "sampling", "TextStream": "sampling", "filter_logits": "sampling",
          "next_token": "sampling", "GREEDY_BELOW": "sampling", "distribution": "sampling"}
__all__ = list(_HOMES)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
