"""Work on a worker thread, seen by the page as a stream of batches.

The decode runs on one of the engine's workers and `emit`s what the page should
know; the page's generator pulls what was emitted so far, in batches, so a slow
redraw never slows the decode.  Stopping the page's generator stops the work.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, TypeVar

from rest_core.app.settings import Cancelled

T = TypeVar("T")
Emit = Callable[[Any], None]


def stream_in_thread(engine: Any, work: Callable[[Emit], Any], wait_s: float = 1.0) -> Generator[list, None, Any]:
    """Run work(emit) on engine.workers; yield lists of what it emitted (empty list: still running).

    The generator's return value is work's; its exception is re-raised here, after every item
    emitted before it was delivered.  When the consumer stops (the visitor pressed Stop or left),
    the next emit raises Cancelled in the worker, which ends the decode after the current step.
    """
    inbox: queue.Queue = queue.Queue()
    stop = threading.Event()

    def emit(item: Any) -> None:
        if stop.is_set():
            raise Cancelled()
        inbox.put(("item", item))

    def main() -> None:
        try:
            inbox.put(("done", work(emit)))
        except BaseException as err:  # handed to the consumer
            inbox.put(("error", err))

    engine.workers.submit(main)
    try:
        while True:
            try:
                kind, value = inbox.get(timeout=wait_s)
            except queue.Empty:
                yield []
                continue
            batch = []
            while kind == "item":
                batch.append(value)
                try:
                    kind, value = inbox.get_nowait()
                except queue.Empty:
                    kind = "more"
            if batch:
                yield batch
            if kind == "done":
                return value
            if kind == "error":
                raise value
    finally:
        stop.set()


def drain(stream: Iterator[list], on_batch: Callable[[list], Iterable[T]]) -> Generator[T, None, Any]:
    """Pull a stream's batches, yield what on_batch makes of each, return the stream's value.

    The stream is closed however this ends (done, failed, or closed by the consumer), which
    stops its work."""
    try:
        while True:
            try:
                batch = next(stream)
            except StopIteration as finished:
                return finished.value
            yield from on_batch(batch)
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


class Disturbance:
    """When this process took the cores a decode needs for something else (the live view building and sending
    its figures, and the browser drawing them right after), so that steps timed meanwhile do not teach the cost
    curve (RestDecoder's `undisturbed`).  Thread-safe enough: one float, written whole."""

    def __init__(self) -> None:
        self.until = 0.0  # perf_counter time the latest disturbance ends
        self.cost_s = 0.0  # what the latest measured figure redraw cost the decode (its steps' extra forward time)
        self.text_cost_s: float | None = None  # what a text update costs the decode (a running estimate)

    def mark(self, until: float) -> None:
        self.until = max(self.until, until)

    def settle(self, at: float) -> None:
        """The disturbance marked open-ended ends at `at`."""
        self.until = at

    def quiet_since(self, since: float) -> bool:
        """Whether no disturbance overlapped the time from `since` until now."""
        return self.until < since


class Throttle:
    """True at most once per `interval_s` (redraws of the streamed text)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.last = 0.0

    def ready(self) -> bool:
        now = time.perf_counter()
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True
