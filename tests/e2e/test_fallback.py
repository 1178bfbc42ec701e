"""deploy.fallback on the cpu target with two tiny models in one real Triton server: under a
burst the BLS model sends the primary's overflow to the fallback, no request fails, every
response names the model that served it, the diversions are counted in a metric, and once the
burst is over traffic returns to the primary; when the primary's process dies, its circuit
breaker opens and the fallback serves everything (the breaker's half-open probing and closing
are tested on a fake clock in tests/unit)."""

import re
import threading
import urllib.request

import pytest
from helpers import make_config

from moepipe.validate import client

BURST = 10
MAX_QUEUE = 2


@pytest.fixture(scope="module")
def with_fallback(tmp_path_factory):
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.config import load_config
    from moepipe.deploy.local import lifecycle

    root = tmp_path_factory.mktemp("fallback")
    # The fallback: another pipeline (same tokenizer: the tiny examples share theirs).
    make_config(root / "small", example="tiny-qwen3-moe")
    run_build(root / "small" / "moepipe.yaml", echo=lambda s: None)
    make_config(root / "main", deploy={"fallback": {
        "config": str(root / "small" / "moepipe.yaml"), "max_queue": MAX_QUEUE,
        "cooldown_s": 600}})  # the circuit, once open, stays open for the module's tests
    path = root / "main" / "moepipe.yaml"
    run_build(path, echo=lambda s: None)
    cfg = load_config(path)
    run_deploy(cfg, echo=lambda s: None)
    try:
        yield cfg
    finally:
        lifecycle.stop(state_dir(cfg), grace=40)


def _ask(cfg, i):
    return client.generate(f"{cfg.deploy.host}:{cfg.deploy.http_port}", "tensorrt_llm_bls",
                           {"text_input": f"Burst request {i}: once upon a time",
                            "max_tokens": 12})


def _served_by(answer):
    value = answer["served_by"]
    return value[0] if isinstance(value, list) else value


def _diversions(cfg):
    url = f"http://{cfg.deploy.host}:{cfg.deploy.metrics_port}/metrics"
    with urllib.request.urlopen(url) as r:
        text = r.read().decode()
    m = re.search(r'^moepipe_fallback_requests_total\{model="tensorrt_llm_bls",reason="queue"\}'
                  r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_burst_overflow_goes_to_the_fallback_and_traffic_returns(with_fallback):
    cfg = with_fallback
    before = _diversions(cfg)
    answers, errors = [None] * BURST, []

    def ask(i):
        try:
            answers[i] = _ask(cfg, i)
        except Exception as e:  # collected: the assertion below names them all
            errors.append(f"{i}: {e}")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == []
    served = [_served_by(a) for a in answers]
    assert all(a["text_output"] for a in answers)
    assert set(served) == {"tensorrt_llm", "tensorrt_llm_fallback"}, served
    diverted = served.count("tensorrt_llm_fallback")
    assert _diversions(cfg) - before == diverted
    # The burst is over: the primary serves again.
    assert [_served_by(_ask(cfg, i)) for i in range(3)] == ["tensorrt_llm"] * 3


def _metric(cfg, name, labels):
    url = f"http://{cfg.deploy.host}:{cfg.deploy.metrics_port}/metrics"
    with urllib.request.urlopen(url) as r:
        text = r.read().decode()
    m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_dead_primary_opens_the_circuit_and_no_request_fails(with_fallback):
    """The primary's backend process dies (the supervisor, which would restart the whole
    server, is stopped first): its first failures are retried on the fallback, then the
    circuit opens and requests go straight there; nobody gets an error."""
    import os
    import signal

    from moepipe.commands.deploy import state_dir
    from moepipe.deploy.local import processes

    cfg = with_fallback
    failures = cfg.deploy.fallback.failures
    procs = processes.deployment_processes(state_dir(cfg))
    processes.kill_all([p for p in procs if p.kind == "supervisor"])
    primary = next(p.pid for p in procs if p.model == "tensorrt_llm_0_0")
    os.kill(primary, signal.SIGKILL)
    errors_before = _metric(cfg, "moepipe_fallback_requests_total",
                            'model="tensorrt_llm_bls",reason="error"')
    served = [_served_by(_ask(cfg, i)) for i in range(failures + 3)]
    assert served == ["tensorrt_llm_fallback"] * len(served)
    retried = _metric(cfg, "moepipe_fallback_requests_total",
                      'model="tensorrt_llm_bls",reason="error"') - errors_before
    assert retried == failures  # then the circuit opened: no more tries on the dead primary
    assert _metric(cfg, "moepipe_fallback_requests_total",
                   'model="tensorrt_llm_bls",reason="circuit"') >= 3
    assert _metric(cfg, "moepipe_circuit_state", 'model="tensorrt_llm_bls"') == 1.0  # open
