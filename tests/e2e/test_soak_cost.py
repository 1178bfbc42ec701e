"""The soak job and the perf job's cost per token against the shared cpu deployment (a real
tritonserver): a short soak (CI-sized: seconds, not the default half hour) passes with the
deployment's own processes measured, its plots render in headless chromium, and perf prices
every point at its measured throughput."""

import json

import pytest
from browser import needs_chromium, open_page, plot_boxes

from moepipe.commands.validate import run_validate
from moepipe.config import CostSection, PerfSection, SoakSection


@pytest.fixture(scope="module")
def soak_report(deployment):
    cfg, ep = deployment
    c = cfg.model_copy(deep=True)  # its workdir: the job finds the server's processes there
    c.validation.load.max_tokens = 8
    c.validation.soak = SoakSection(seconds=16, rate=2, window_s=4, sample_s=1, drain_s=15)
    report, paths = run_validate(c, ep.http, ep.grpc, jobs=["soak"], echo=lambda s: None)
    return report, paths


def test_a_short_soak_passes_and_measures_the_deployment(soak_report, deployment):
    report, (js, _, _) = soak_report
    (job,) = report.jobs
    cases = {c.name: c for c in job.cases}
    assert {n: c.status for n, c in cases.items()} == {
        "steady_load": "passed", "error_rate": "passed", "latency_drift": "passed",
        "memory_trend": "passed", "kv_trend": "passed", "no_restarts": "passed",
        "client_not_saturated": "passed"}, {n: c.message for n, c in cases.items()}
    data = json.loads(js.read_text())["jobs"][0]["data"]
    assert data["outcomes"]["ok"] >= 20 and data["error_rate"] == 0
    # the server and its five Python backend stubs: a real, plausible RSS
    rss = [y for _, y in data["memory"]["samples"]]
    assert len(rss) >= 12 and 200 < min(rss) < 20000
    assert data["kv_total"] == 16  # max_batch_size x the model instance (moepipe_kv_slots)
    assert cases["kv_trend"].details["idle"] == 0
    assert cases["kv_trend"].details["drained_after_s"] is not None
    drift = data["latency_drift"]
    assert drift["first_window_ms"]["count"] >= 4 and drift["last_window_ms"]["count"] >= 4


@needs_chromium
def test_the_soak_plots_render_in_chromium(soak_report, tmp_path):
    _, (_, _, page) = soak_report
    shown = open_page(page, tmp_path)
    assert shown.console == []
    boxes = {b[0]: b for b in plot_boxes(shown.dom)}
    for name in ("soak-latency", "soak-outcomes", "soak-memory", "soak-kv"):
        _, _, _, width, height, elements = boxes[name]
        assert width > 100 and height > 100 and elements > 20, name


def test_perf_prices_each_point_at_its_measured_throughput(deployment, tmp_path):
    cfg, ep = deployment
    c = cfg.model_copy(deep=True)
    c.workdir = tmp_path
    c.validation.load.max_tokens = 8
    c.validation.perf = PerfSection(concurrency=[2], rates=[], requests=8, duration_s=6)
    c.validation.cost = CostSection(usd_per_hour=3.6, max_usd_per_million_tokens=1e-6)
    report, (js, _, page) = run_validate(c, ep.http, ep.grpc, jobs=["perf"],
                                         echo=lambda s: None)
    (point,) = json.loads(js.read_text())["jobs"][0]["data"]["points"]
    s, cost = point["summary"], point["cost"]
    assert s["input_tokens_per_s"] > 0  # the server's own num_input_tokens
    assert cost["usd_per_million_output_tokens"] == pytest.approx(
        3.6 / (s["output_tokens_per_s"] * 3600) * 1e6, rel=1e-4)
    assert cost["usd_per_million_tokens"] == pytest.approx(
        3.6 / ((s["output_tokens_per_s"] + s["input_tokens_per_s"]) * 3600) * 1e6, rel=1e-4)
    gate = {x.name: x for x in report.jobs[0].cases}["cost_per_token"]
    assert gate.status == "failed"
    assert "US$ per million tokens at the cheapest point (concurrency 2" in gate.message
    assert "US$ / M output tokens" in page.read_text()


def test_prometheus_records_the_cost_of_the_live_token_rate(deployment, tmp_path):
    """A real Prometheus (Debian's package) scrapes the cpu deployment under traffic and
    evaluates the rendered cost rules: US$ per million output tokens is the price over the
    live output-token rate, per million tokens over input + output, and the alert, with a
    limit below it, fires."""
    import shutil
    import subprocess
    import threading
    import time
    import urllib.parse
    import urllib.request

    from helpers import free_ports

    from moepipe.deploy.cluster import monitoring
    from moepipe.validate import client

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (scripts/install-test-tools.sh)")
    cfg, ep = deployment
    rules = monitoring.rules(window_s=6, for_s=2, slo_p99_ms=6e4, max_error_ratio=0.5,
                             max_queue_ms=6e4, max_expert_imbalance=100, usd_per_hour=3.6,
                             max_usd_per_million_tokens=1e-6)
    (tmp_path / "rules.yml").write_text(monitoring.dump(rules))
    conf = monitoring.scrape_config(local_target=ep.metrics, scrape_interval_s=1,
                                    evaluation_interval_s=1, rule_file="rules.yml")
    (tmp_path / "prometheus.yml").write_text(monitoring.dump(conf))
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            client.generate(ep.http, "ensemble", {"text_input": "The quick brown fox",
                                                  "max_tokens": 8})

    def query(expr):
        with urllib.request.urlopen(f"{url}/api/v1/query?query=" + urllib.parse.quote(expr),
                                    timeout=5) as r:
            return {tuple(sorted(x["metric"].items())): float(x["value"][1])
                    for x in json.loads(r.read())["data"]["result"]}

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        deadline, firing = time.monotonic() + 60, []
        while time.monotonic() < deadline and not firing:
            time.sleep(1)
            try:
                with urllib.request.urlopen(f"{url}/api/v1/alerts", timeout=5) as r:
                    firing = [a for a in json.loads(r.read())["data"]["alerts"]
                              if a["labels"]["alertname"] == "MoepipeCostPerTokenHigh"
                              and a["state"] == "firing"]
            except OSError:
                continue  # not up yet
        # one evaluation: the records and the rates they come from, at the same instant
        r = monitoring.recorded(6)  # the rules' window
        both = query(f"{r.cost_output} * {r.output_rate}")
        blended = query(f"{r.cost} * ({r.input_rate} + {r.output_rate})")
        rates = query(r.input_rate)
    finally:
        stop.set()
        worker.join(timeout=30)
        proc.terminate()
        proc.wait(timeout=20)
    assert firing, "MoepipeCostPerTokenHigh never fired"
    per_million = 3.6 / 3600 * 1e6  # US$ per million tokens at one token per second
    assert list(both.values()) == [pytest.approx(per_million)]
    assert list(blended.values()) == [pytest.approx(per_million)]
    assert list(rates.values())[0] > 0  # moepipe_prompt_tokens_total counts
