"""Continuous batching for the server: the engine (`nanollama4.engine`) stepping on a thread of its own.

Requests arrive from the HTTP side on any thread (`submit`, `submit_all`) and wait in a bounded queue;
the loop admits them into free rows and steps while any row decodes, so every request in flight
decodes in one batched pass per step. Events go back through each request's `emit`, called from the
loop's thread. A request's tokens are those offline `generate` gives with the same seed: it is the
same engine, and rows never see each other.
"""

from __future__ import annotations

import logging
import threading

import torch

from ..engine import Engine as StepEngine
from ..engine import Event, Finished, Request, TokenEvent
from ..engine.cache import CACHE_SHARE, SlotCache, SlotLayer, check_cache_fits
from ..errors import Nanollama4Error
from ..model import Transformer
from ..tokenizer import Tokenizer

log = logging.getLogger("nanollama4.serve")

__all__ = ["Engine", "Request", "TokenEvent", "Finished", "Event", "QueueFull", "Closing", "SlotCache", "SlotLayer",
           "check_cache_fits", "CACHE_SHARE", "log"]


class QueueFull(Nanollama4Error):
    """More requests are waiting than --max-queue allows; the client should retry later."""


class Closing(Nanollama4Error):
    """The server is shutting down and takes no new requests."""


class Engine(StepEngine):
    """The engine with a bounded queue and a loop on its own thread. `submit` from any thread; `step(new)`
    admits exactly the requests given (the loop hands it those it took from the queue)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, max_batch: int = 16, max_queue: int = 64,
                 max_context: int | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue ({max_queue}) must be >= 0")
        super().__init__(model, tokenizer, max_batch=max_batch, max_context=max_context)
        self.max_queue = max_queue
        self._lock = threading.Condition()
        self._closing = False
        self._admitting: list[Request] = []  # taken from `waiting`, not yet in a row
        self._thread = threading.Thread(target=self._loop, name="nanollama4-engine", daemon=True)

    # ------------------------------------------------------------------ control
    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, request: Request) -> None:
        """Queue a request; it joins the batch at the next step with a free row."""
        self.submit_all([request])

    def submit_all(self, requests: list[Request]) -> None:
        """Queue requests together or not at all: QueueFull when they would leave more than max_queue
        waiting beyond the free rows, Closing after `close`."""
        for r in requests:
            self.check(r)
        with self._lock:
            if self._closing:
                raise Closing("the server is shutting down")
            self._forget_cancelled()
            room = self.max_queue + max(0, self.free_rows) - len(self.waiting)
            if len(requests) > room:
                raise QueueFull(f"{len(self.rows)} requests are decoding and {len(self.waiting)} waiting "
                                f"(--max-batch {self.max_batch}, --max-queue {self.max_queue})")
            self.waiting.extend(requests)
            self._lock.notify()

    def stop_accepting(self) -> None:
        """Refuse new requests (Closing); those in flight go on."""
        with self._lock:
            self._closing = True
            self._lock.notify()

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Take no new requests; let those in flight finish (or cancel them), then stop the loop."""
        with self._lock:
            self._closing = True
            if cancel:
                for r in (*self.rows, *self.prefilling, *self.waiting, *self._admitting):
                    r.cancel()
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def busy(self) -> tuple[int, int]:
        """(requests admitted: decoding or being prefilled, requests waiting)."""
        with self._lock:
            return len({*self.rows, *self.prefilling, *self._admitting}), len(self.waiting)

    @property
    def closing(self) -> bool:
        return self._closing

    def _forget_cancelled(self) -> None:
        """Waiting requests whose client went away leave the queue (under the lock) and end now."""
        if any(r.cancelled for r in self.waiting):
            gone = [r for r in self.waiting if r.cancelled]
            keep = [r for r in self.waiting if not r.cancelled]
            self.waiting.clear()
            self.waiting.extend(keep)
            for r in gone:
                self._finish(r, "cancelled")

    # ------------------------------------------------------------------ the loop
    def step(self, new: list[Request] = ()) -> None:  # type: ignore[override]
        super().step(list(new))

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while not self.has_work and not self._closing:
                    self._lock.wait()
                if self._closing and not self.has_work:
                    return
                self._forget_cancelled()
                new = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.free_rows))]
                self._admitting = new
            try:
                self.step(new)
            except Exception as e:  # a bug in the batched pass: end what is in flight, keep serving
                log.exception("a step failed")
                for r in [*self.rows, *self.prefilling, *new]:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                self.rows, self.prefilling = [], []
            with self._lock:
                self._admitting = []
