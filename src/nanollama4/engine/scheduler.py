"""The engine's scheduler: which requests wait, which rows they hold, and how much of a prompt a step takes.

    add(requests)   -> waiting      first come, first served (past max_queue: QueueFull, none queued)
    take()          -> admitting    as many waiting requests as rows are free, oldest first
    admit(r)        -> prefilling   r holds a row while its prompt goes in, `chunk(r)` tokens per step
    seat(r)         -> rows         r decodes in cache row i, i its index in `rows`
    retire(r)       <- anywhere     r leaves; a decoding row's gap is filled by the last row

It knows nothing of the model or the cache: `retire` says which cache row must move and the engine moves
it. So the policy (who goes next, where a request is, what a step prefills) reads, and is tested, without
a model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ..base.errors import Nanollama4Error
from .request import Request

PREFILL_CHUNK = 64  # prompt tokens a step prefills per request (longer prompts take several steps)


class QueueFull(Nanollama4Error):
    """More requests would wait than the queue holds (max_queue); the caller should retry later."""


class Scheduler:
    """Where each request is: waiting, admitting (taken for the next step), prefilling or decoding in a row.

    `max_batch` requests hold rows at once (admitting, prefilling or decoding); `max_queue` more may wait
    beyond the free rows (None: any number, as offline generation queues every prompt at once)."""

    def __init__(self, max_batch: int, max_queue: int | None = None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch ({max_batch}) must be >= 1")
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue ({max_queue}) must be >= 0")
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.waiting: deque[Request] = deque()
        self.admitting: list[Request] = []  # taken from `waiting` for the next step, not started yet
        self.prefilling: list[Request] = []  # their prompts going in a chunk per step; each holds a row
        self.rows: list[Request] = []  # request i decodes in cache row i

    # ------------------------------------------------------------------ the queue
    def add(self, requests: Iterable[Request]) -> None:
        """Queue requests together or not at all (QueueFull when they would leave more than max_queue
        waiting beyond the free rows). The one way into the engine: `Engine.add` checks, then calls this."""
        requests = list(requests)
        if self.max_queue is not None:
            room = self.max_queue + max(0, self.free_rows) - len(self.waiting)
            if len(requests) > room:
                raise QueueFull(f"{self.admitted} requests are running and {len(self.waiting)} waiting "
                                f"(--max-batch {self.max_batch}, --max-queue {self.max_queue})")
        self.waiting.extend(requests)

    def forget_cancelled(self) -> list[Request]:
        """The waiting requests whose caller cancelled them leave the queue (returned, to be finished)."""
        gone = [r for r in self.waiting if r.cancelled]
        if gone:
            keep = [r for r in self.waiting if not r.cancelled]
            self.waiting.clear()
            self.waiting.extend(keep)
        return gone

    # ------------------------------------------------------------------ admission
    @property
    def free_rows(self) -> int:
        return self.max_batch - len(self.rows) - len(self.prefilling) - len(self.admitting)

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting, admitted or decoding."""
        return bool(self.rows or self.prefilling or self.admitting or self.waiting)

    @property
    def admitted(self) -> int:
        """Requests holding a row: taken, being prefilled or decoding."""
        return len(self.rows) + len(self.prefilling) + len(self.admitting)

    def take(self) -> list[Request]:
        """The waiting requests that start at the next step, oldest first, as many as rows are free; they
        hold their rows from now on (`admitting`), so a request queued meanwhile finds them taken."""
        new = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.free_rows))]
        self.admitting.extend(new)
        return new

    def admit(self, r: Request) -> None:
        """r's prompt starts going in (r may come from `take` or straight from a caller's list)."""
        self._leave(r)
        self.prefilling.append(r)

    def cancelled(self) -> list[Request]:
        """The requests holding a row whose caller cancelled them: decoding rows first, then prompts."""
        return [r for r in (*self.rows, *self.prefilling) if r.cancelled]

    # ------------------------------------------------------------------ prefill
    def prefills(self) -> list[Request]:
        """The prompts that get a chunk at this step: every one being prefilled, in the order admitted."""
        return list(self.prefilling)

    def chunk(self, r: Request) -> tuple[int, int]:
        """The prompt positions [start, end) r's next prefill pass feeds. A traced or scored prompt goes in
        whole (every position's observations or logits are kept from one pass); others `prefill_chunk` at a
        time, so a long prompt admitted mid-stream does not stall the decoding rows for its whole length."""
        whole = r.trace or r.prompt_logprobs
        end = len(r.prompt_ids) if whole else min(len(r.prompt_ids), r.prefilled + self.prefill_chunk)
        return r.prefilled, end

    def seat(self, r: Request) -> int:
        """r's prompt is in: it decodes from now on, in the row returned (the next after the others)."""
        self._leave(r)
        self.rows.append(r)
        return len(self.rows) - 1

    # ------------------------------------------------------------------ retiring
    def retire(self, r: Request) -> tuple[int, int] | None:
        """r leaves, wherever it is. When it decoded in row i and a later row exists, the last row takes its
        place so the rows stay [0, n): returns (last, i), the cache row to move and where to."""
        if r not in self.rows:
            self._leave(r)
            return None
        i, last = self.rows.index(r), len(self.rows) - 1
        self.rows[i] = self.rows[last]
        self.rows.pop()
        return (last, i) if i != last else None

    def clear(self) -> list[Request]:
        """Every request holding a row leaves at once (returned): after a step failed as a whole."""
        gone = [*self.rows, *self.prefilling, *self.admitting]
        self.rows, self.prefilling, self.admitting = [], [], []
        return gone

    def _leave(self, r: Request) -> None:
        for place in (self.admitting, self.prefilling, self.waiting):
            if r in place:
                place.remove(r)
                return
