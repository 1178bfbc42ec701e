"""What the cpu deployment really exports, scraped from a live server: every metric the
rendered Grafana dashboard reads, and TensorRT-LLM's nv_trt_llm_request_metrics /
nv_trt_llm_kv_cache_block_metrics with upstream's labels (custom_metrics_reporter.cc:
model, version and the category label)."""

import re
import time
import urllib.request

from moepipe.deploy.cluster import grafana
from moepipe.deploy.metric_names import TRTLLM_FAMILIES, metrics_in
from moepipe.validate import client

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def _scrape(cfg):
    url = f"http://{cfg.deploy.host}:{cfg.deploy.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def test_dashboard_metrics_and_trtllm_families_are_exported(deployment):
    cfg, _ = deployment
    url = f"{cfg.deploy.host}:{cfg.deploy.http_port}"
    for i in range(3):
        client.generate(url, "ensemble", {"text_input": f"metrics {i}", "max_tokens": 4})
    deadline = time.monotonic() + 15
    while True:  # the model publishes at most every 0.5 s, from its outbox thread
        samples = _scrape(cfg)
        names = {n for n, _, _ in samples} | {"up"}  # `up` is Prometheus' own
        needed = {m for p in grafana.panels_for("cpu") for e, _ in p.queries
                  for m in metrics_in(e)}
        if needed <= names or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert needed - names == set()
    for family in ("nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics"):
        label, values = TRTLLM_FAMILIES[family]
        series = [lab for n, lab, _ in samples if n == family]
        assert {s[label] for s in series} == set(values)
        assert all(set(s) == {"model", "version", label} for s in series)
        assert {s["model"] for s in series} == {"tensorrt_llm"}
    values = {(n, lab.get("request_type") or lab.get("kv_cache_block_type")): v
              for n, lab, v in samples if n.startswith("nv_trt_llm_")}
    assert values[("nv_trt_llm_request_metrics", "max")] == cfg.build.max_batch_size
    assert values[("nv_trt_llm_kv_cache_block_metrics", "tokens_per")] == 32
    kv_max = values[("nv_trt_llm_kv_cache_block_metrics", "max")]
    assert kv_max == cfg.build.max_batch_size * -(-cfg.build.max_seq_len // 32)


def _promtool():
    import shutil
    import sys
    from pathlib import Path

    import pytest

    path = shutil.which("promtool") or shutil.which("promtool",
                                                    path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip("promtool not installed (scripts/install-test-tools.sh)")
    return path


# What promtool says of Triton's own metric names (measured on Triton 2.51's scrape).
TRITON_NAMING = ('counter metrics should have "_total" suffix',
                 "metric names should not contain abbreviated units",
                 "metric name should not include type 'summary'",
                 'non-histogram and non-summary metrics should not have "_count" suffix')


def test_promtool_check_metrics_finds_nothing_in_moepipes_metrics(deployment):
    """`promtool check metrics` (Prometheus' own linter) on a live scrape of the cpu
    deployment, after requests so that every family has samples: nothing in moepipe's
    families (moepipe_*: no gauge named _total, counters with it, base units). Triton's own
    families are upstream's: their findings are only the naming Triton chose (counters
    without _total, durations in us, _count and summary in names), listed here so that a new
    kind of finding shows."""
    import subprocess

    cfg, _ = deployment
    url = f"{cfg.deploy.host}:{cfg.deploy.http_port}"
    for i in range(2):
        client.generate(url, "ensemble", {"text_input": f"lint {i}", "max_tokens": 4})
    time.sleep(1.5)  # published at most every 0.5 s
    with urllib.request.urlopen(f"http://{cfg.deploy.host}:{cfg.deploy.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    assert "moepipe_kv_slots{" in text and "moepipe_batch_occupancy_ratio{" in text
    res = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    findings = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    ours = [f for f in findings if f.startswith("moepipe_")]
    assert ours == []
    # Triton's nv_inference_* (core src/metrics.cc): names fixed upstream, as Triton 2.51 has
    # them; the nv_trt_llm_* families moepipe exports as TensorRT-LLM names them pass
    upstream = [f for f in findings if not f.startswith("moepipe_")]
    assert all(f.startswith("nv_inference_") and f.endswith(TRITON_NAMING)
               for f in upstream), upstream
    assert res.returncode in (0, 3) and (res.returncode == 0) == (findings == []), res
