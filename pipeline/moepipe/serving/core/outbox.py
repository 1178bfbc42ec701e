"""Responses sent, and cancellation polled, on one thread of their own.

Both are round trips to the server: an engine should not wait for them between steps. And they
must not race: a FINAL response sent from one thread while another asks the same sender whether
it was cancelled made the server ask a released response factory (tritonserver SIGSEGV in
``TRITONBACKEND_ResponseFactoryIsCancelled``, seen under a burst of refusals). So every send
and every poll of a model goes through its outbox, in order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from .responses import FINAL


class Tracked:
    """A request's response sender as the outbox thread sees it: ``is_cancelled`` answers
    what the last poll found (no round trip)."""

    def __init__(self, sender):
        self.sender = sender
        self.cancelled = False
        self.done = False

    def is_cancelled(self) -> bool:
        return self.cancelled

    def send(self, response=None, flags: int = 0) -> None:
        if self.done:  # the request already ended (e.g. an error of another row)
            return
        self.sender.send(response, flags=flags)
        if flags & FINAL:
            self.done = True


class Outbox:
    """Runs ``put`` calls in order on its thread and asks each live sender every ``poll_s``
    whether its client cancelled. ``warn`` reports a failed call (a client gone away must not
    stop the others)."""

    def __init__(self, warn: Callable[[str], None], poll_s: float = 0.25):
        self.poll_s = poll_s
        self._warn = warn
        self._queue: queue.Queue = queue.Queue()
        self._live: list[Tracked] = []
        self._thread = threading.Thread(target=self._run, name="moepipe-outbox", daemon=True)
        self._thread.start()

    def track(self, sender) -> Tracked:
        tracked = Tracked(sender)
        self._queue.put((self._live.append, (tracked,)))
        return tracked

    def put(self, fn: Callable, *args) -> None:
        self._queue.put((fn, args))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        polled = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.poll_s)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                fn, args = item
                try:
                    fn(*args)
                except Exception as e:
                    self._warn(f"sending a response failed: {e}")
            if time.monotonic() - polled >= self.poll_s:
                polled = time.monotonic()
                self._live = [t for t in self._live if not t.done]
                for t in self._live:
                    if not t.cancelled and t.sender.is_cancelled():
                        t.cancelled = True
