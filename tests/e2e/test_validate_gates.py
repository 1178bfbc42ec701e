"""Gates that must fail, on a deployment of its own (tp=2, moe_ep=2): tiny-mixtral with its
routers made skewed, so every token goes to experts 0-3 (EP rank 0) and experts 4-7 idle;
a burst beyond its bounded queue (deploy.max_queue_size: 8) shed as busy; then the recovery
gate with a restart limit of 0 (deploy.max_restarts: the supervisor cleans up and gives up;
the test kills last)."""

import concurrent.futures
import json
import os
import shutil
import signal
import urllib.error
import urllib.request

import numpy as np
import pytest
from helpers import make_config

from moepipe.commands.validate import run_validate
from moepipe.config import BalanceSection, BurstSection, RecoverySection

MAX_QUEUE = 8


def skew_routers(src, dst):
    """Copy a Mixtral checkpoint, rewriting every router so that, for any hidden state h with
    h.w != 0, the top-2 experts are {0, 2} (h.w > 0) or {1, 3} (h.w < 0)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, w in tensors.items():
            if name.endswith("block_sparse_moe.gate.weight"):
                u = w[0] / np.linalg.norm(w[0])
                w = np.zeros_like(w)
                w[0], w[1], w[2], w[3] = 50 * u, -50 * u, 40 * u, -40 * u
                tensors[name] = w
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import endpoint_for
    from moepipe.deploy.local import lifecycle
    from moepipe.deploy.local.state import ServerError, read_state
    from moepipe.examples import write_example

    root = tmp_path_factory.mktemp("skewed")
    model = skew_routers(write_example("tiny-mixtral", root / "tiny"), root / "skewed")
    cfg = make_config(root / "work", model={"path": str(model), "example": None},
                      # supervised, never restarted; 16 slots + 8 waiting requests at most
                      deploy={"max_restarts": 0, "max_queue_size": MAX_QUEUE})
    run_build(root / "work" / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    backend = None
    try:
        from moepipe.validate.jobs.recovery import backend_pid

        st = read_state(state_dir(cfg))
        backend = backend_pid(st.pid) if st else None
        yield cfg, endpoint_for(cfg, None, None)
    finally:
        try:
            lifecycle.stop(state_dir(cfg), grace=10)
        except ServerError:  # the supervisor gave up after the recovery test's kill
            pass
        if backend is not None:  # a killed server can leave its backend stub behind
            try:
                os.kill(backend, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_skewed_router_fails_the_balance_gate(skewed, tmp_path):
    cfg, ep = skewed
    c = cfg.model_copy(deep=True)
    c.workdir = tmp_path
    c.validation.balance = BalanceSection(requests=8, min_tokens=100, max_std_over_mean=0.5)
    report, _ = run_validate(c, ep.http, ep.grpc, jobs=["balance"], echo=lambda s: None)
    cases = {x.name: x for x in report.jobs[0].cases}
    gate = cases["expert_balance"]
    assert gate.status == "failed", gate
    assert "validate.balance.max_std_over_mean" in gate.message
    data = report.jobs[0].data
    for row in data["layer_expert"]:  # experts 4-7 received nothing
        assert row[4:] == [0.0] * 4
    for row in data["layer_rank"]:  # all of it on EP rank 0
        assert row == [1.0, 0.0]


def test_a_burst_beyond_capacity_is_shed_as_busy_and_service_goes_on(skewed, tmp_path):
    """4/s, then 100/s for 1.5 s (far beyond what 2 cores serve), then 4/s through the
    ensemble: the requests over a queue bound are refused at once as busy (Triton's "Exceeds
    maximum queue size", from Triton's queue of a model or the engine's), none fails
    otherwise, and the requests after the burst are answered normally."""
    cfg, ep = skewed
    c = cfg.model_copy(deep=True)
    c.workdir = tmp_path
    c.validation.burst = BurstSection(base_rate=4, factor=25, before_s=1.0, burst_s=1.5,
                                      after_s=3.0, bin_s=0.5)
    # 128 tokens per request hold a slot long enough that 100 requests/s exceed 16 slots + 8
    # waiting places on any machine (16-token requests were served as fast as they came on
    # an idle one)
    c.validation.load.max_tokens = 128
    report, _ = run_validate(c, ep.http, ep.grpc, jobs=["burst"], echo=lambda s: None)
    job = report.jobs[0]
    cases = {x.name: x for x in job.cases}
    assert cases["server_survived"].status == "passed", cases["server_survived"]
    phases = job.data["phases"]
    assert phases["during"]["rejected"] > 0, phases["during"]
    for name, p in phases.items():
        assert p["failed"] == p["timeout"] == 0, (name, p)
    # service goes on: the last answers after the burst are served, none refused (the bin in
    # which the queue drains may still refuse one on a loaded machine)
    answered = [r for r in job.data["timeline"] if r["t"] >= 4.0 and (r["ok"] or r["rejected"])]
    assert answered and answered[-1]["ok"] > 0 and answered[-1]["rejected"] == 0, answered
    # The engine's bound, as a plain HTTP client sees it: 48 requests at once straight to
    # tensorrt_llm; its 16 KV-cache slots and 8 waiting places are taken, the rest refused at
    # once (Triton's HTTP frontend reports an error response as 400, whatever its code).
    body = {"input_ids": [54, 260, 402, 305, 77], "input_lengths": 5,
            "request_output_len": 128}
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        answers = list(pool.map(lambda _: _post(ep.http, "tensorrt_llm", body), range(48)))
    ok = [text for code, text in answers if code == 200]
    busy = [(code, text) for code, text in answers if code != 200]
    slots = cfg.build.max_batch_size
    assert len(ok) >= slots + MAX_QUEUE and busy, answers
    for code, text in busy:
        assert code in (400, 503) and "Exceeds maximum queue size: " in text, (code, text)
        assert f"{slots} slots (deploy.max_queue_size {MAX_QUEUE})" in text, text
    assert _post(ep.http, "ensemble", {"text_input": "hello", "max_tokens": 4})[0] == 200


def _post(url, model, body):
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_recovery_fails_with_a_restart_limit_of_0(skewed, tmp_path):
    cfg, ep = skewed
    c = cfg.model_copy(deep=True)
    c.validation.recovery = RecoverySection(kill=["server"], rate=4, warmup_s=1.0,
                                            max_seconds=3.0, after_s=1.0)
    report, _ = run_validate(c, ep.http, ep.grpc, jobs=["recovery"], echo=lambda s: None)
    case = report.jobs[0].cases[0]
    assert case.name == "kill_server" and case.status == "failed", case
    assert "no successful response within 3s after the server was killed" in case.message
    assert "supervisor" in case.message
    run = report.jobs[0].data["runs"][0]
    assert run["requests_lost"] > 0 and run["time_to_first_success_s"] is None
