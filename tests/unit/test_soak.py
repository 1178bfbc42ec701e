"""The soak job's judgement on runs whose figures are known: a memory or KV trend that would
pass its bound over the run is a leak, a plateau after warm-up is not; errors (not-sent ones
too) against max_error_rate; latency drift first window against last; the gauges it reads.
(tests/e2e/test_soak.py runs it against a real deployment.)"""

import random

import pytest

from moepipe.config import SoakSection
from moepipe.validate.jobs import soak
from moepipe.validate.load import LoadResult, Sample
from moepipe.validate.report import JobResult

SECONDS, WINDOW = 600.0, 60.0


def _samples(rate=2.0, slow_after=None, errors=0):
    """A steady run: one request per 1/rate s, 100 ms each (3x slower after ``slow_after``)."""
    out, t, rng = [], 0.0, random.Random(0)
    while t < SECONDS:
        lat = 0.1 * (3 if slow_after is not None and t >= slow_after else 1) * rng.uniform(0.9, 1.1)
        out.append(Sample("short", t, "ok", first=t + lat / 4, done=t + lat, tokens=8))
        t += 1 / rate
    for i in range(errors):
        out[i * 7] = Sample("short", out[i * 7].sent, "not_sent" if i % 2 else "failed",
                            done=out[i * 7].sent, error="boom")
    return out


def _probes(rss, kv=lambda t: 2.0, every=5.0):
    return [soak.Probe(t, rss(t), (100,), kv(t), 8.0) for t in
            [i * every for i in range(int(SECONDS / every))]]


def _judge(samples, probes, drained=2.0, **settings):
    s = SoakSection(seconds=SECONDS, window_s=WINDOW, **settings)
    job = JobResult("soak")
    state = {"res": LoadResult(samples, SECONDS), "probes": probes, "idle": (0.0, 8.0),
             "drained": drained}
    soak.judge(job, s, state, "127.0.0.1:8000", local=True)
    return {c.name: c for c in job.cases}, job.data


def _warmup_then_flat(t):  # allocations while warming up, flat after: no leak
    return 1500 + min(t, WINDOW) * 3 + random.Random(int(t)).uniform(-2, 2)


def test_a_steady_run_passes_and_says_what_it_measured():
    cases, data = _judge(_samples(), _probes(_warmup_then_flat))
    assert {n: c.status for n, c in cases.items()} == {
        "error_rate": "passed", "latency_drift": "passed", "memory_trend": "passed",
        "kv_trend": "passed", "no_restarts": "passed"}
    assert abs(data["memory"]["growth_over_run"]) < 10  # the warm-up's 180 MiB left out
    assert data["latency_drift"]["p99_ratio"] == pytest.approx(1, abs=0.15)
    assert len(data["memory"]["samples"]) == 120 and data["kv_total"] == 8.0


def test_a_memory_slope_that_would_pass_the_bound_over_the_run_is_a_leak():
    # 0.5 MiB/s: 300 MiB over the 600 s run > 256 MiB, though each step is tiny
    cases, data = _judge(_samples(), _probes(lambda t: 1500 + 0.5 * t))
    assert cases["memory_trend"].status == "failed"
    assert cases["memory_trend"].message == (
        "memory grows 1.8e+03 MiB/h: 300 MiB (+-0.00) over the 600s run > 256 "
        "(validate.soak.max_memory_growth_mib); a leak")
    assert data["memory"]["slope_per_hour"] == pytest.approx(1800, rel=1e-3)
    cases, _ = _judge(_samples(), _probes(lambda t: 1500 + 0.3 * t))  # 180 MiB: within
    assert cases["memory_trend"].status == "passed"


def test_kv_slots_that_are_never_freed_are_a_leak():
    cases, _ = _judge(_samples(), _probes(_warmup_then_flat, kv=lambda t: 1 + t / 100))
    assert cases["kv_trend"].status == "failed" and "kv_use grows" in cases["kv_trend"].message
    cases, _ = _judge(_samples(), _probes(_warmup_then_flat), drained=None)
    assert cases["kv_trend"].status == "failed"
    assert "did not return to its idle level (0)" in cases["kv_trend"].message



def test_kv_use_that_only_fluctuates_is_no_leak_however_short_the_run():
    """KV use is the requests in flight when sampled (0-3 slots at 2 req/s): on a 24 s run its
    least-squares slope alone read 2 slots of growth (a CI soak failed on it); the gate counts
    growth beyond its error, so the same noise passes and a real leak under it still fails."""
    noisy = [soak.Probe(t, 1500.0, (100,), float(k), 16.0) for t, k in
             [(8 + i * 2, v) for i, v in enumerate([0, 1, 0, 1, 3, 2, 3, 1])]]
    s = SoakSection(seconds=24.0, window_s=8.0, sample_s=2.0)
    job = JobResult("soak")
    soak.judge(job, s, {"res": LoadResult(_samples()[:48], 24.0), "probes": noisy,
                        "idle": (0.0, 16.0), "drained": 0.1}, "127.0.0.1:8000", local=True)
    kv = job.data["kv_use"]
    assert kv["growth_over_run"] > kv["bound"]  # the bare slope would have failed it
    assert {c.name: c.status for c in job.cases}["kv_trend"] == "passed"
    # one slot more every 10 s, under the same noise: a leak
    rng = random.Random(1)
    cases, data = _judge(_samples(), _probes(_warmup_then_flat,
                                             kv=lambda t: 1 + t / 10 + rng.uniform(-1, 1)))
    assert cases["kv_trend"].status == "failed", data["kv_use"]


def test_errors_not_sent_requests_included_against_the_bound():
    cases, data = _judge(_samples(errors=4), _probes(_warmup_then_flat))
    assert cases["error_rate"].status == "failed"
    assert cases["error_rate"].message.startswith(
        "error rate 0.3333% > 0.1000% (validate.soak.max_error_rate): 0 rejected, 2 failed, "
        "0 timeout, 2 not sent; first: boom")
    cases, _ = _judge(_samples(errors=4), _probes(_warmup_then_flat), max_error_rate=0.01)
    assert cases["error_rate"].status == "passed"


def test_latency_drift_compares_the_last_window_with_the_first():
    cases, data = _judge(_samples(slow_after=300), _probes(_warmup_then_flat))
    assert data["latency_drift"]["p50_ratio"] == pytest.approx(3, rel=0.15)
    assert cases["latency_drift"].status == "passed"  # reported; no gate by default
    cases, _ = _judge(_samples(slow_after=300), _probes(_warmup_then_flat), max_p99_drift=2)
    assert cases["latency_drift"].status == "failed"
    assert "(validate.soak.max_p99_drift)" in cases["latency_drift"].message


def test_a_restarted_server_fails_the_run():
    probes = _probes(_warmup_then_flat)
    for p in probes[60:]:
        p.servers = (200,)
    cases, _ = _judge(_samples(), probes)
    assert cases["no_restarts"].status == "failed"
    assert cases["no_restarts"].message == ("the server was restarted during the run (server "
                                            "pids [100, 200])")


def test_a_remote_deployment_says_its_memory_is_not_measured():
    probes = [soak.Probe(p.t, None, (), p.kv_used, p.kv_total)
              for p in _probes(_warmup_then_flat)]
    job = JobResult("soak")
    soak.judge(job, SoakSection(seconds=SECONDS, window_s=WINDOW),
               {"res": LoadResult(_samples(), SECONDS), "probes": probes, "idle": (0.0, 8.0),
                "drained": 1.0}, "10.0.0.5:8000", local=False)
    memory = {c.name: c for c in job.cases}["memory_trend"]
    assert memory.status == "skipped" and "10.0.0.5:8000 is not this workdir's" in memory.message


def test_the_gauges_it_reads():
    cpu = ('# TYPE moepipe_kv_slots_used gauge\nmoepipe_kv_slots_used{model="tensorrt_llm"} 3\n'
           'moepipe_kv_slots_used{model="fallback"} 1\nmoepipe_kv_slots{model='
           '"tensorrt_llm"} 8\nmoepipe_kv_slots{model="fallback"} 4\n')
    assert soak.kv_use(cpu) == (4.0, 12.0)
    engine = ('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm'
              '",version="1"} 120\nnv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",'
              'model="tensorrt_llm",version="1"} 4096\n')
    assert soak.kv_use(engine) == (120.0, 4096.0)
    assert soak.kv_use("nv_inference_count 3\n") is None


def test_trend_and_thinning():
    assert soak.trend([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2)
    assert soak.trend([(0, 1), (1, 3)]) is None
    pts = list(range(1000))
    kept = soak.thin(pts, 300)
    assert len(kept) == 300 and kept[0] == 0 and kept[-1] == 999


def test_a_soak_shorter_than_two_windows_is_refused():
    with pytest.raises(ValueError, match="at least two windows"):
        SoakSection(seconds=90, window_s=60)
