"""The load jobs against the shared deployment (short CI versions), their JSON / JUnit / HTML
reports, the HTML opened in headless chromium, and an SLO set below what the server can do."""

import json
import xml.etree.ElementTree as ET

import pytest
from browser import needs_chromium, open_page, plot_boxes

from moepipe.commands.validate import run_validate
from moepipe.config import BalanceSection, BurstSection, LongTailSection, PerfSection

LOAD_JOBS = ["perf", "burst", "long-tail", "balance"]


def short_config(cfg, workdir, **slo):
    """The deployment's config with CI-sized jobs and reports written under ``workdir``."""
    c = cfg.model_copy(deep=True)
    c.workdir = workdir
    v = c.validation
    v.load.max_tokens = 8
    v.perf = PerfSection(concurrency=[1, 4], rates=[4.0], requests=12, duration_s=6)
    v.burst = BurstSection(base_rate=2, factor=4, before_s=2, burst_s=2, after_s=3)
    v.long_tail = LongTailSection(rate=3, duration_s=3, long_share=0.2, long_prompt_tokens=160)
    v.balance = BalanceSection(requests=12, min_tokens=200)
    for k, value in slo.items():
        setattr(v.slo, k, value)
    return c


@pytest.fixture(scope="module")
def load_report(deployment, tmp_path_factory):
    cfg, ep = deployment
    workdir = tmp_path_factory.mktemp("validate-load")
    c = short_config(cfg, workdir)
    report, paths = run_validate(c, ep.http, ep.grpc, jobs=LOAD_JOBS, echo=lambda s: None)
    return report, paths


def test_load_jobs_pass_and_write_json_junit_and_html(load_report):
    report, (js, xml, page) = load_report
    failed = [(j.job, c.name, c.message) for j in report.jobs for c in j.cases
              if c.status not in ("passed", "skipped")]
    assert report.passed, failed
    data = json.loads(js.read_text())
    assert [j["job"] for j in data["jobs"]] == LOAD_JOBS
    perf = data["jobs"][0]["data"]
    assert [p["label"] for p in perf["points"]] == ["concurrency 1", "concurrency 4", "rate 4"]
    for point in perf["points"]:
        s = point["summary"]
        assert s["ok"] == 12 and s["error_rate"] == 0
        assert s["latency_ms"]["p99"] >= s["latency_ms"]["p50"] >= s["ttft_ms"]["p50"] > 0
        # tokens/s from the server's own counts: max_tokens per request unless one ended early
        # (end id); a random-weight model rarely samples it
        assert 4 * s["requests_per_s"] < s["output_tokens_per_s"] <= 8 * s["requests_per_s"] * 1.01
    burst = data["jobs"][1]["data"]
    assert burst["burst"] == [2, 4] and len(burst["timeline"]) == 7
    assert burst["phases"]["during"]["ok"] > burst["phases"]["before"]["ok"]
    shares = data["jobs"][3]["data"]["layer_expert"]
    assert len(shares) == 4 and all(abs(sum(row) - 1) < 1e-3 for row in shares)
    assert len(data["jobs"][3]["data"]["layer_rank"][0]) == 2  # moe_ep=2
    suites = ET.parse(xml).getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == LOAD_JOBS
    assert page.name == "validate.html" and page.stat().st_size > 10_000


@needs_chromium
def test_html_report_renders_in_chromium_without_errors(load_report, tmp_path):
    from PIL import Image  # moepipe[test]

    _, (_, _, page) = load_report
    shown = open_page(page, tmp_path)
    assert shown.console == []
    boxes = plot_boxes(shown.dom)
    names = [b[0] for b in boxes]
    for expected in ("perf-concurrency-latency", "perf-rate-throughput", "perf-cdf",
                     "burst-latency", "burst-outcomes", "long-tail-cdf", "balance-experts",
                     "balance-ranks"):
        assert expected in names
    image = Image.open(shown.screenshot).convert("RGB")
    for name, left, top, width, height, _ in boxes:
        assert width > 100 and height > 100, name
        crop = image.crop((left, top, left + width, top + height))
        colours = crop.getcolors(maxcolors=1 << 16) or []
        # drawn: more than background and a few grid tones, and a real share of ink
        assert len(colours) > 8, f"{name} looks blank"
        ink = sum(n for n, c in colours if sum(c) < 600)
        assert ink > 0.01 * width * height, f"{name} has almost nothing drawn"


def test_an_slo_below_what_the_server_can_do_fails_naming_figure_and_limit(deployment,
                                                                            tmp_path):
    cfg, ep = deployment
    c = short_config(cfg, tmp_path, ttft_p99_ms=0.01)
    c.validation.perf = PerfSection(concurrency=[2], rates=[], requests=6, duration_s=5)
    report, _ = run_validate(c, ep.http, ep.grpc, jobs=["perf"], echo=lambda s: None)
    assert not report.passed
    case = next(x for x in report.jobs[0].cases if x.name == "concurrency_2")
    assert case.status == "failed"
    assert "ttft_ms.p99" in case.message and "> 0.01 (slo.ttft_p99_ms)" in case.message


def test_server_exports_latency_histograms_and_occupancy_gauges(load_report, deployment):
    """After the load jobs: real Prometheus histograms (cumulative buckets ending in +Inf that
    equal the count, so histogram_quantile works) and the occupancy gauges."""
    import re
    import urllib.request

    from moepipe.serving.metrics import BUCKETS

    cfg, _ = deployment
    with urllib.request.urlopen(f"http://{cfg.deploy.host}:{cfg.deploy.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    for name in ("moepipe_request_latency_seconds", "moepipe_time_to_first_token_seconds",
                 "moepipe_queue_time_seconds"):
        assert f"# TYPE {name} histogram" in text
        buckets = [(float(le), float(v)) for le, v in re.findall(
            name + r'_bucket\{[^}]*le="([^"]+)"[^}]*\}\s+(\S+)', text)]
        assert [le for le, _ in buckets] == [*BUCKETS, float("inf")]
        counts = [v for _, v in buckets]
        assert counts == sorted(counts)  # cumulative
        total = float(re.search(name + r"_count\{[^}]*\}\s+(\S+)", text).group(1))
        assert counts[-1] == total > 0
    assert re.search(r'moepipe_kv_slots\{model="tensorrt_llm"\} 16', text)
    for gauge in ("moepipe_batch_occupancy_ratio", "moepipe_queued_requests", "moepipe_kv_slots_used",
                  "moepipe_kv_tokens_used"):
        assert re.search(gauge + r'\{model="tensorrt_llm"\} \S+', text), gauge


def test_a_plan_over_two_processes_returns_both_processes_samples():
    """Two load-driver processes, each sending its share (an e2e test: they run for seconds)."""
    import socket

    from moepipe.validate import load as driver
    from moepipe.validate.load import LoadPlan, Prompt

    with socket.socket() as s:  # a port nothing listens on: every request is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = driver.run_load(LoadPlan(f"127.0.0.1:{port}", [Prompt("short", "x", 4)],
                                      schedule=[(1.1, 6.0)], arrival="constant",
                                      max_requests=6, processes=2, protocol="http",
                                      timeout_s=2, duration_s=5))
    # 3/s each for 1.1 s: both processes send 3
    assert len(result.samples) == 6 and {s.status for s in result.samples} == {"failed"}
    assert len(result.client_cpu_s) == 2 and len(result.client_wall_s) == 2
