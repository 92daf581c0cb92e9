"""Continuous batching for the server: the engine (`nanollama4.engine`) stepping on a thread of its own.

Requests arrive from the HTTP side on any thread (`submit`, `submit_all`) and wait in a bounded queue;
the loop admits them into free rows and steps while any row decodes, so every request in flight
decodes in one batched pass per step. Events go back through each request's `emit`, called from the
loop's thread. A request's tokens are those offline `generate` gives with the same seed: it is the
same engine, and rows never see each other.
"""

from __future__ import annotations

import threading

import torch

from ..base.errors import Nanollama4Error
from ..engine.core import Engine
from ..engine.request import Event, Finished, Request, TokenEvent
from ..engine.scheduler import QueueFull
from ..model.tokenizer import Tokenizer
from ..model.transformer import Transformer
from .logs import log

__all__ = ["BackgroundEngine", "Request", "TokenEvent", "Finished", "Event", "QueueFull", "Closing", "log"]


class Closing(Nanollama4Error):
    """The server is shutting down and takes no new requests."""


class BackgroundEngine(Engine):
    """The engine with a bounded queue and a loop on its own thread. `submit` from any thread; the loop
    takes the requests that start from the queue under its lock and steps with exactly those
    (`step(new)`), so the queue is touched under the lock only."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, max_batch: int = 16, max_queue: int = 64,
                 max_context: int | None = None) -> None:
        super().__init__(model, tokenizer, max_batch=max_batch, max_context=max_context, max_queue=max_queue)
        self.max_queue = max_queue
        self._lock = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="nanollama4-engine", daemon=True)

    # ------------------------------------------------------------------ control
    def start(self) -> BackgroundEngine:
        self._thread.start()
        return self

    def submit(self, request: Request) -> None:
        """Queue a request; it joins the batch at the next step with a free row."""
        self.submit_all([request])

    def submit_all(self, requests: list[Request]) -> None:
        """Queue requests together or not at all: QueueFull when they would leave more than max_queue
        waiting beyond the free rows, Closing after `close`."""
        with self._lock:
            if self._closing:
                raise Closing("the server is shutting down")
            self._forget_cancelled()
            self.add(*requests)
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
                for r in (*self.rows, *self.scheduler.prefilling, *self.scheduler.admitting, *self.scheduler.waiting):
                    r.cancel()
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def busy(self) -> tuple[int, int]:
        """(requests admitted: decoding or being prefilled, requests waiting)."""
        with self._lock:
            return self.scheduler.admitted, len(self.scheduler.waiting)

    @property
    def closing(self) -> bool:
        return self._closing

    def _forget_cancelled(self) -> None:
        """Waiting requests whose client went away leave the queue (under the lock) and end now."""
        for r in self.scheduler.forget_cancelled():
            self._finish(r, "cancelled")

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while not self.has_work and not self._closing:
                    self._lock.wait()
                if self._closing and not self.has_work:
                    return
                self._forget_cancelled()
                new = self.scheduler.take()
            try:
                self.step(new)
            except Exception as e:  # a bug in the batched pass: end what is in flight, keep serving
                log.exception("a step failed")
                for r in [*self.scheduler.clear(), *new]:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
