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


# Reasons a request went to the fallback (the ``reason`` label of the counter).
REASONS = ("queue", "circuit", "error")


class FallbackPolicy:
    """The BLS side: routes each request, retries on the fallback when the primary fails before
    answering anything, and keeps the metrics ``moepipe_fallback_requests_total{model,reason}``
    (counter) and ``moepipe_circuit_state{model}`` (gauge: 0 closed, 1 open, 2 half-open)."""

    def __init__(self, router: OverloadRouter, pb_utils=None, model: str = "tensorrt_llm_bls",
                 is_server_error=lambda error: True):
        self.router = router
        self.is_server_error = is_server_error
        self._counters = {}
        self._state_gauge = None
        # Metric calls go to the server through the stub's IPC channel: one thread at a time
        # (concurrent calls from the BLS worker threads crash the Python backend).
        self._metrics_lock = threading.Lock()
        self._families = []
        if pb_utils is not None:
            counter = pb_utils.MetricFamily(
                name="moepipe_fallback_requests_total",
                description="Requests the BLS model sent to the fallback model, by reason",
                kind=pb_utils.MetricFamily.COUNTER)
            gauge = pb_utils.MetricFamily(
                name="moepipe_circuit_state",
                description="Circuit breaker of the primary model: 0 closed, 1 open, 2 half-open",
                kind=pb_utils.MetricFamily.GAUGE)
            self._families = [counter, gauge]
            self._counters = {r: counter.Metric(labels={"model": model, "reason": r})
                              for r in REASONS}
            self._state_gauge = gauge.Metric(labels={"model": model})

    def _count(self, reason: str) -> None:
        with self._metrics_lock:
            if reason in self._counters:
                self._counters[reason].increment(1)
            self._set_state()

    def _set_state(self) -> None:
        if self._state_gauge is not None:
            self._state_gauge.set(self.router.state)

    def serve(self, call):
        """Yield ``(model, response)`` from ``call(model)``: the primary's responses, or the
        fallback's when routed there or when the primary fails before its first response."""
        route = self.router.acquire()
        if not route.primary:
            self._count(route.reason)
            for response in call(route.model):
                yield route.model, response
            return
        ok, answered, failed = True, False, False
        try:
            for response in call(route.model):
                if response.has_error() and self.is_server_error(response.error()):
                    ok = False
                    if not answered:
                        failed = True
                        break
                answered = True
                yield route.model, response
        finally:
            self.router.release(route, ok)
            with self._metrics_lock:
                self._set_state()
        if failed:
            self._count("error")
            for response in call(self.router.fallback):
                yield self.router.fallback, response
