"""Load-job figures without a server: percentiles, SLO verdicts, goodput, burst timelines,
expert-balance arithmetic, the Prometheus parsing, the driver's share of a plan, and the HTML
report rendered from a report dict."""

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from moepipe.config import parse_config
from moepipe.validate import html, stats
from moepipe.validate import load as driver
from moepipe.validate.jobs import balance
from moepipe.validate.load import LoadPlan, LoadResult, Prompt, Sample, _share, classify


def _sample(sent, latency, ttft, tokens=10, status="ok", kind="short"):
    return Sample(kind, sent, status, first=sent + ttft, done=sent + latency, tokens=tokens)


def test_distribution_matches_numpy_percentiles():
    values = [0.01 * i for i in range(1, 101)]
    d = stats.distribution(values)
    assert d["count"] == 100
    assert d["p50"] == pytest.approx(np.percentile(values, 50) * 1000, abs=1e-3)
    assert d["p99"] == pytest.approx(np.percentile(values, 99) * 1000, abs=1e-3)
    assert d["max"] == pytest.approx(1000.0)
    assert stats.distribution([None, None]) == {"count": 0}


def test_summary_counts_outcomes_and_server_tokens():
    samples = [_sample(i * 0.1, 0.5, 0.05, tokens=8) for i in range(8)]
    samples += [Sample("short", 0.9, "rejected", done=0.91, error="busy"),
                Sample("short", 0.95, "timeout", done=1.0)]
    s = stats.summarize(LoadResult(samples, 2.0, [0.1], [2.0]))
    assert (s["ok"], s["rejected"], s["timeout"], s["failed"]) == (8, 1, 1, 0)
    assert s["error_rate"] == pytest.approx(0.2)
    # 8 ok requests x 8 server-counted tokens over the window from first send to last end
    assert s["output_tokens_per_s"] == pytest.approx(64 / 1.2, rel=1e-3)
    assert s["itl_ms"]["p50"] == pytest.approx((0.5 - 0.05) / 7 * 1000, rel=1e-3)
    assert s["client_cpu_max"] == pytest.approx(0.05)


def test_slo_violations_name_the_figure_and_the_limit():
    summary = {"ttft_ms": {"p99": 120.0}, "latency_ms": {"p99": 300.0}, "itl_ms": {"p99": 5.0},
               "output_tokens_per_s": 40.0, "error_rate": 0.0}
    slo = {"ttft_p99_ms": 100.0, "latency_p99_ms": 500.0, "itl_p99_ms": None,
           "min_output_tokens_per_s": 50.0, "max_error_rate": 0.0}
    missed = stats.slo_violations(summary, slo)
    assert missed == ["ttft_ms.p99 120 > 100 (slo.ttft_p99_ms)",
                      "output_tokens_per_s 40 < 50 (slo.min_output_tokens_per_s)"]
    assert stats.slo_violations({"ttft_ms": {"count": 0}}, {"ttft_p99_ms": 1.0}) == [
        "ttft_ms.p99 was not measured (no successful requests; slo.ttft_p99_ms 1)"]


def test_goodput_counts_only_requests_within_every_slo():
    samples = [_sample(0, 0.2, 0.01), _sample(0, 0.2, 0.2), _sample(0, 0.9, 0.01),
               Sample("short", 0, "failed", done=0.1)]
    slo = {"ttft_p99_ms": 50.0, "latency_p99_ms": 500.0}
    assert stats.goodput(samples, slo, 2.0) == pytest.approx(0.5)


def test_timeline_bins_by_send_time():
    samples = [_sample(0.2, 0.1, 0.01), _sample(1.5, 0.3, 0.01),
               Sample("short", 1.6, "rejected", done=1.6)]
    rows = stats.timeline(samples, 1.0, 3.0)
    assert [r["t"] for r in rows] == [0.0, 1.0, 2.0]
    assert (rows[1]["ok"], rows[1]["rejected"], rows[2]["ok"]) == (1, 1, 0)
    assert rows[1]["p99_ms"] == pytest.approx(300.0) and rows[2]["p99_ms"] is None


def test_busy_errors_are_rejections():
    assert classify("in ensemble 'ensemble', Exceeds maximum queue size") == "rejected"
    assert classify("Server is busy: 64 requests waiting") == "rejected"
    assert classify("Request timeout expired: waited more than 500 ms") == "rejected"
    assert classify("Maximum queue size of 8 has been reached, please try again later") \
        == "rejected"
    assert classify("failed to connect to all addresses") == "failed"


def test_a_plan_splits_over_processes_without_losing_load():
    plan = LoadPlan("127.0.0.1:1", [Prompt("short", "x", 4)], concurrency=5, max_requests=11,
                    processes=2)
    parts = [_share(plan, i, 2) for i in range(2)]
    assert sum(p.concurrency for p in parts) == 5
    assert sum(p.max_requests for p in parts) == 11
    assert len({p.seed for p in parts}) == 2
    rate = LoadPlan("127.0.0.1:1", [], schedule=[(5, 4.0), (2, 10.0)], processes=2)
    assert _share(rate, 1, 2).schedule == [(5, 2.0), (2, 5.0)]
    even = LoadPlan("127.0.0.1:1", [], schedule=[(5, 4.0)], processes=2, arrival="constant")
    # interleaved: process 1 sends half an interval (of the 2/s each sends) after process 0
    assert [_share(even, i, 2).schedule for i in range(2)] == [[(5, 2.0)], [(0.25, 0.0), (5, 2.0)]]



def _send_times(plan, monkeypatch):
    """When an open-loop plan sends, on a virtual clock (no server, no real waiting)."""
    clock = [0.0]

    class Client:
        def now(self):
            return clock[0]

        async def send(self, prompt):
            return Sample(prompt.kind, clock[0], "ok", done=clock[0])

    real_sleep = asyncio.sleep

    async def sleep(seconds):
        await real_sleep(0)  # requests created before this wait start now
        clock[0] += seconds

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return sorted(s.sent for s in asyncio.run(driver._open(plan, Client(), plan.duration_s)))


def test_open_loop_arrivals_are_evenly_spaced_or_poisson(monkeypatch):
    prompts = [Prompt("short", "x", 4)]
    even = LoadPlan("127.0.0.1:1", prompts, schedule=[(1.0, 8.0), (0.5, 4.0)],
                    arrival="constant")
    # 8/s for 1 s then 4/s for 0.5 s: every 1/8 s, then every 1/4 s from the step
    assert _send_times(even, monkeypatch) == [0.125 * k for k in range(1, 8)] + [1.25]
    poisson = LoadPlan("127.0.0.1:1", prompts, schedule=[(100.0, 8.0)], max_requests=400,
                       duration_s=200)
    gaps = np.diff(_send_times(poisson, monkeypatch))
    assert len(gaps) == 399 and gaps.std() > 0.5 * gaps.mean()  # exponential: std == mean
    with pytest.raises(ValueError, match="poisson or constant"):
        driver.run_load(LoadPlan("127.0.0.1:1", prompts, schedule=[(1.0, 1.0)],
                                 arrival="uniform"))



def test_a_load_worker_stops_sending_on_sigterm_and_still_reports():
    with socket.socket() as s:  # a port nothing listens on: every request is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = LoadPlan(f"127.0.0.1:{port}", [Prompt("short", "x", 4)], schedule=[(600.0, 20.0)],
                    max_requests=100000, duration_s=600, timeout_s=2, protocol="http")
    proc = subprocess.Popen([sys.executable, "-m", "moepipe.validate.load"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(json.dumps({"plan": asdict(plan), "t0": time.monotonic()}) + "\n")
        proc.stdin.flush()
        status = Path(f"/proc/{proc.pid}/status")
        for _ in range(600):  # until the worker catches SIGTERM (its handler is installed)
            caught = int(re.search(r"SigCgt:\s*(\w+)", status.read_text())[1], 16)
            if caught >> (signal.SIGTERM - 1) & 1:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)  # not the 600 s of its plan
    finally:
        proc.kill()
    assert proc.returncode == 0
    report = json.loads(out)
    assert report["cpu"] >= 0 and report["wall"] > 0
    assert {s["status"] for s in report["samples"]} <= {"failed"}


METRICS = """# HELP moepipe_expert_tokens_total Tokens routed
# TYPE moepipe_expert_tokens_total counter
moepipe_expert_tokens_total{expert="0",layer="0",model="tensorrt_llm"} 30
moepipe_expert_tokens_total{expert="1",layer="0",model="tensorrt_llm"} 10
moepipe_expert_tokens_total{expert="2",layer="0",model="tensorrt_llm"} 0
moepipe_expert_tokens_total{expert="3",layer="0",model="tensorrt_llm"} 0
nv_inference_count{model="ensemble",version="1"} 3
"""


def test_expert_counters_parse_and_balance_figures():
    after = balance.parse(METRICS)
    assert after == {(0, 0): 30.0, (0, 1): 10.0, (0, 2): 0.0, (0, 3): 0.0}
    m = balance.load_matrix({(0, 0): 10.0}, after)
    assert m.tolist() == [[20.0, 10.0, 0.0, 0.0]]
    stats_ = balance.imbalance(m[0])
    assert stats_["share"] == [pytest.approx(2 / 3, abs=1e-4), pytest.approx(1 / 3, abs=1e-4),
                               0.0, 0.0]
    assert stats_["std_over_mean"] == pytest.approx(np.std([20, 10, 0, 0]) / 7.5, abs=1e-4)
    assert stats_["max_over_mean"] == pytest.approx(20 / 7.5, abs=1e-4)
    # EP rank r holds experts [r*E/ep, (r+1)*E/ep): rank 0 = experts 0, 1
    assert balance.by_rank(m, 2).tolist() == [[30.0, 0.0]]
    with pytest.raises(ValueError, match="do not split"):
        balance.by_rank(m, 3)


def test_every_load_job_has_a_config_section_with_working_defaults():
    cfg = parse_config({"model": {"example": "tiny-mixtral"},
                        "validate": {"jobs": ["perf", "burst", "long-tail", "balance",
                                              "recovery"],
                                     "slo": {"ttft_p99_ms": 50},
                                     "balance": {"max_std_over_mean": 0.5},
                                     "recovery": {"max_seconds": 0.5}}})
    v = cfg.validation
    assert v.slo.ttft_p99_ms == 50 and v.slo.max_error_rate == 0.0
    assert v.balance.max_std_over_mean == 0.5 and v.balance.min_tokens > 0
    assert v.burst.factor == 5.0 and v.long_tail.long_share == pytest.approx(0.1)
    assert v.recovery.kill == ["rank", "server", "backend"]


def _report():
    pts = []
    for c in (1, 4):
        res = LoadResult([_sample(i * 0.05, 0.05 * c + 0.001 * i, 0.01) for i in range(20)],
                         1.0, [0.1], [1.0])
        pts.append({"mode": "concurrency", "load": c, "label": f"concurrency {c}",
                    "summary": stats.summarize(res), "goodput": 1.0})
    lat = [0.05 + 0.001 * i for i in range(40)]
    rows = stats.timeline([_sample(i * 0.25, 0.05, 0.01) for i in range(40)], 1.0, 10.0)
    return {"passed": False, "target": "cpu", "endpoint": {"http": "127.0.0.1:1"},
            "started": 0.0, "jobs": [
                {"job": "perf", "passed": False,
                 "cases": [{"name": "concurrency_4", "status": "failed", "seconds": 1.0,
                            "message": "ttft_ms.p99 12 > 1 (slo.ttft_p99_ms)", "details": {}}],
                 "data": {"points": pts, "latency_hist": stats.histogram(lat),
                          "latency_cdf": {"all": stats.cdf(lat)}}},
                {"job": "burst", "passed": True, "cases": [],
                 "data": {"timeline": rows, "burst": [3.0, 6.0], "factor": 5}},
                {"job": "balance", "passed": True, "cases": [],
                 "data": {"layer_expert": [[0.5, 0.5, 0, 0], [0.25] * 4],
                          "layer_rank": [[1.0, 0.0], [0.5, 0.5]]}}]}


def test_html_report_is_self_contained_and_draws_every_plot():
    page = html.render(_report())
    assert page.startswith("<!doctype html>")
    # nothing is fetched: no external scripts, styles, images or fonts
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    names = re.findall(r'<svg class="plot" data-plot="([^"]+)"', page)
    assert names == ["perf-concurrency-latency", "perf-concurrency-throughput", "perf-hist",
                     "perf-cdf", "burst-latency", "burst-outcomes", "balance-experts",
                     "balance-ranks"]
    assert "ttft_ms.p99 12 &gt; 1 (slo.ttft_p99_ms)" in page
    for svg in re.findall(r"<svg.*?</svg>", page, re.S):
        assert re.search(r"<(polyline|rect|circle)[^>]*(points|height)=", svg)
        assert "nan" not in svg.lower()


def test_the_cpu_targets_latency_metrics_are_registered_for_dashboards():
    from moepipe.deploy.metric_names import EXPORTED
    from moepipe.serving.metrics import BUCKETS, GAUGES, HISTOGRAMS

    for name, _ in HISTOGRAMS.values():
        assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= EXPORTED["cpu"]
    assert {name for name, _ in GAUGES.values()} <= EXPORTED["cpu"]
    assert BUCKETS == sorted(BUCKETS) and BUCKETS[0] > 0


def test_the_http_driver_stamps_when_its_request_was_written():
    """``wrote`` lies after ``sent`` (connect included) and before the server could answer:
    a loopback server that answers 50 ms after reading the whole request."""
    got = {}

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head)[1])
        await reader.readexactly(length)
        got["read"] = time.monotonic()
        await asyncio.sleep(0.05)
        event = json.dumps({"text_output": "hi", "num_output_tokens": 1}).encode()
        chunk = b"data: " + event + b"\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t0 = time.monotonic()
        client = driver._HttpClient(f"127.0.0.1:{port}", "ensemble", 5.0, t0)
        async with server:
            return await client.send(Prompt("short", "x", 4)), t0

    s, t0 = asyncio.run(main())
    assert s.status == "ok" and s.tokens == 1
    assert s.sent <= s.wrote <= got["read"] - t0 <= s.first
    assert s.first - s.wrote >= 0.05  # the server's 50 ms lie between the two
