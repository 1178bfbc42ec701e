"""Overload fallback of the BLS model: which model serves the next request.

The primary serves unless

* the requests it holds (sent, not yet finished) reach ``max_queue`` (0: no limit), or
* its circuit breaker is open: ``failures`` failed requests within ``window_s`` seconds open it;
  after ``cooldown_s`` it lets one probe request through (half-open): the probe's success
  closes it, its failure opens it for another cool-down.

Then the fallback serves, and the route says why (``queue`` or ``circuit``). Pure Python and
thread-safe (BLS requests run on worker threads); the clock is injectable for tests. It ships
beside the BLS model.py (which must run without moepipe installed, in NVIDIA's image).
"""

import threading
import time
from collections import deque
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half_open"}


@dataclass(frozen=True)
class Route:
    model: str
    reason: str  # "" (primary), "probe" (primary, half-open), "queue" or "circuit" (fallback)
    primary: bool


class OverloadRouter:
    def __init__(self, primary: str, fallback: str, *, max_queue: int, failures: int,
                 window_s: float, cooldown_s: float, clock=time.monotonic):
        if failures < 1 or window_s <= 0 or cooldown_s < 0 or max_queue < 0:
            raise ValueError("failures >= 1, window_s > 0, cooldown_s >= 0, max_queue >= 0")
        self.primary, self.fallback = primary, fallback
        self.max_queue, self.failures = max_queue, failures
        self.window_s, self.cooldown_s = window_s, cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._opened_at = 0.0
        self._probing = False
        self._recent: deque[float] = deque()
        self.in_flight = 0

    @property
    def state(self) -> int:
        with self._lock:
            self._tick(self._clock())
            return self._state

    def _tick(self, now: float) -> None:
        if self._state == OPEN and now - self._opened_at >= self.cooldown_s:
            self._state, self._probing = HALF_OPEN, False

    def _open(self, now: float) -> None:
        self._state, self._opened_at, self._probing = OPEN, now, False
        self._recent.clear()

    def acquire(self) -> Route:
        """The model for the next request; a primary route must be released."""
        with self._lock:
            now = self._clock()
            self._tick(now)
            if self._state == OPEN or (self._state == HALF_OPEN and self._probing):
                return Route(self.fallback, "circuit", False)
            if self._state == HALF_OPEN:
                self._probing = True
                self.in_flight += 1
                return Route(self.primary, "probe", True)
            if self.max_queue and self.in_flight >= self.max_queue:
                return Route(self.fallback, "queue", False)
            self.in_flight += 1
            return Route(self.primary, "", True)

    def release(self, route: Route, ok: bool) -> None:
        """Report how a primary route ended (``ok``: it finished without a server error)."""
        if not route.primary:
            return
        with self._lock:
            now = self._clock()
            self.in_flight -= 1
            if route.reason == "probe":
                if ok:
                    self._state, self._probing = CLOSED, False
                    self._recent.clear()
                else:
                    self._open(now)
                return
            if ok or self._state != CLOSED:
                return
            self._recent.append(now)
            while self._recent and now - self._recent[0] > self.window_s:
                self._recent.popleft()
            if len(self._recent) >= self.failures:
                self._open(now)
