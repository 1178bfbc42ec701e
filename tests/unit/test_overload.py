"""The BLS model's overload router: queue limit and circuit breaker (closed -> open ->
half-open -> closed), on a fake clock."""

import importlib.util
import threading

import pytest

from moepipe.deploy.render.templates import templates_root

PATH = templates_root() / "common" / "model_repo" / "tensorrt_llm_bls" / "1" / "overload.py"
spec = importlib.util.spec_from_file_location("overload", PATH)
overload = importlib.util.module_from_spec(spec)
spec.loader.exec_module(overload)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def router(clock, **kw):
    args = dict(max_queue=2, failures=3, window_s=10, cooldown_s=5) | kw
    return overload.OverloadRouter("tensorrt_llm", "tensorrt_llm_fallback", clock=clock, **args)


def test_queue_limit_sends_the_overflow_to_the_fallback_and_frees_on_release():
    r = router(Clock())
    a, b, c = r.acquire(), r.acquire(), r.acquire()
    assert [x.model for x in (a, b, c)] == ["tensorrt_llm"] * 2 + ["tensorrt_llm_fallback"]
    assert c.reason == "queue"
    r.release(c, True)  # a fallback route changes nothing
    r.release(a, True)
    assert r.acquire().model == "tensorrt_llm"


def test_breaker_opens_after_k_failures_in_the_window_then_probes_and_closes():
    clock = Clock()
    r = router(clock, max_queue=0)
    for _ in range(2):
        r.release(r.acquire(), False)
    clock.now += 11  # the first two failures leave the window
    r.release(r.acquire(), False)
    assert r.state == overload.CLOSED
    r.release(r.acquire(), False)
    r.release(r.acquire(), False)
    assert r.state == overload.OPEN
    assert r.acquire() == overload.Route("tensorrt_llm_fallback", "circuit", False)
    clock.now += 5
    assert r.state == overload.HALF_OPEN
    probe = r.acquire()
    assert probe == overload.Route("tensorrt_llm", "probe", True)
    assert r.acquire().reason == "circuit"  # one probe at a time
    r.release(probe, True)
    assert r.state == overload.CLOSED and r.acquire().model == "tensorrt_llm"


def test_failed_probe_reopens_for_another_cooldown():
    clock = Clock()
    r = router(clock, failures=1)
    r.release(r.acquire(), False)
    clock.now += 5
    probe = r.acquire()
    r.release(probe, False)
    assert r.state == overload.OPEN
    clock.now += 4.9
    assert r.acquire().reason == "circuit"
    clock.now += 0.1
    assert r.acquire().reason == "probe"


def test_in_flight_count_is_exact_under_threads():
    r = router(Clock(), max_queue=1000)

    def work():
        for _ in range(500):
            r.release(r.acquire(), True)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert r.in_flight == 0


@pytest.mark.parametrize("bad", [dict(failures=0), dict(window_s=0), dict(max_queue=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        router(Clock(), **bad)


class Resp:
    def __init__(self, text, error=None):
        self.text, self._error = text, error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


def test_policy_retries_on_the_fallback_when_the_primary_fails_first():
    r = router(Clock(), failures=2)
    policy = overload.FallbackPolicy(r)
    calls = []

    def call(model):
        calls.append(model)
        if model == "tensorrt_llm":
            return iter([Resp("", error="UNAVAILABLE")])
        return iter([Resp("a"), Resp("b")])

    out = list(policy.serve(call))
    assert [(m, x.text) for m, x in out] == [("tensorrt_llm_fallback", "a"),
                                             ("tensorrt_llm_fallback", "b")]
    assert calls == ["tensorrt_llm", "tensorrt_llm_fallback"] and r.in_flight == 0
    list(policy.serve(call))
    assert r.state == overload.OPEN  # two failures in the window
    calls.clear()
    assert [m for m, _ in policy.serve(call)] == ["tensorrt_llm_fallback"] * 2
    assert calls == ["tensorrt_llm_fallback"]  # open: the primary is not even tried


def test_policy_keeps_client_errors_and_mid_stream_errors_on_the_primary():
    r = router(Clock(), failures=1)
    policy = overload.FallbackPolicy(r, is_server_error=lambda e: e != "INVALID_ARG")
    out = list(policy.serve(lambda m: iter([Resp("", error="INVALID_ARG")])))
    assert [m for m, _ in out] == ["tensorrt_llm"] and r.state == overload.CLOSED
    out = list(policy.serve(lambda m: iter([Resp("a"), Resp("", error="INTERNAL")])))
    assert [m for m, _ in out] == ["tensorrt_llm", "tensorrt_llm"]
    assert r.state == overload.OPEN  # counted, but the client already had tokens


class Pb:
    class MetricFamily:
        COUNTER, GAUGE = "counter", "gauge"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels):  # noqa: N802 - pb_utils' spelling
            return Pb.Value(self.name, labels)

    class Value:
        def __init__(self, name, labels):
            self.name, self.labels, self.value = name, labels, 0

        def increment(self, n):
            self.value += n

        def set(self, v):
            self.value = v


def test_policy_counts_diversions_by_reason():
    r = router(Clock(), max_queue=1)
    policy = overload.FallbackPolicy(r, Pb)
    held = policy.serve(lambda m: iter([Resp("x")]))
    next(held)  # the primary holds one request
    list(policy.serve(lambda m: iter([Resp("y")])))
    assert policy._counters["queue"].value == 1
    assert policy._counters["queue"].labels == {"model": "tensorrt_llm_bls", "reason": "queue"}
    list(held)
    assert r.in_flight == 0
