"""What goes into the engine and what comes out: a `Request`, then its `TokenEvent`s and one `Finished`.

Apart from the engine so that the scheduler, the engine and their callers share these types without
importing each other.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .runner import Prefill
    from .sampling import Sampling, TextStream
    from .trace import StepTrace


@dataclass
class TokenEvent:
    """One new token of a request."""

    token_id: int
    text: str  # the text that became safe to show with this token (held back near a possible stop string, and
    # while a character's bytes are not all here: never part of one)
    logprob: float | None = None  # log-probability of the token under the model (temperature 1, unfiltered)
    top: list[tuple[int, float]] | None = None  # the most likely tokens and their log-probabilities
    trace: StepTrace | None = None  # with Request.trace: the step that chose this token


@dataclass
class Finished:
    """A request is over: the last of its events."""

    reason: str  # "stop" (a stop id or string), "length" (max_tokens), "cancelled" or "error"
    text: str  # text still held back, now safe to show
    prompt_tokens: int
    completion_tokens: int
    prompt_logprobs: list[float | None] | None = None  # with Request.prompt_logprobs: each prompt token's
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    error: str | None = None
    stop_id: int | None = None  # the stop id that ended the request (not sent as a TokenEvent)


Event = TokenEvent | Finished
_ids = itertools.count(1)


@dataclass(eq=False)  # a request is itself: two with equal fields are still two rows
class Request:
    """One prompt to continue. `emit` is called with each event, in order (from the engine's thread when
    the server runs it). max_tokens 0 only scores the prompt (with prompt_logprobs) and ends."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    emit: Callable[[Event], None]
    logprobs: int | None = None  # None: no log-probabilities; n: the chosen token's and the n most likely
    prompt_logprobs: bool = False  # also score the prompt's own tokens (echo with logprobs)
    trace: bool = False  # attach each step's routes, attention and odds to its token
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cancelled: bool = False  # set from any thread; the engine drops the row at its next step
    # the engine's own state
    generator: torch.Generator | None = field(default=None, repr=False)
    text: TextStream | None = field(default=None, repr=False)
    tokens: list[int] = field(default_factory=list, repr=False)  # the prompt and every token so far
    prefill_cache: Prefill | None = field(default=None, repr=False)  # the runner's, while its prompt goes in
    prefilled: int = 0  # prompt tokens already in prefill_cache
    generated: int = 0
    position: int = 0  # where the newest token goes
    last: int = 0  # the newest token, fed at the next step
    finished: bool = False
    prompt_scores: tuple = (None, None)  # with prompt_logprobs: each prompt token's and the top ones
    started: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled = True
