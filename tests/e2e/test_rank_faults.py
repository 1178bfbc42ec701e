"""A rank group deployed on a real tritonserver (tiny-mixtral, tp=2 / moe_ep=2: rank 0 in the
server's ``tensorrt_llm`` model, rank 1 its own process): SIGKILL of the worker rank ends the
requests in flight with UNAVAILABLE at once (none hangs), refuses new ones, withdraws the
group's readiness, the supervisor starts the rank group again and service returns with the same
answers; ``moepipe stop`` leaves no rank behind, also in the middle of such a restart. Times are
printed, not asserted (the recovery job and the benchmark measure them)."""

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers import make_config

from moepipe.commands.build import run_build
from moepipe.commands.deploy import run_deploy, state_dir
from moepipe.deploy.local import lifecycle, processes


def _post(cfg, path, body, timeout=60):
    req = urllib.request.Request(f"http://127.0.0.1:{cfg.deploy.http_port}{path}",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _generate(cfg, max_tokens=8, timeout=60):
    return _post(cfg, "/v2/models/ensemble/generate",
                 {"text_input": "It is a truth universally acknowledged",
                  "max_tokens": max_tokens}, timeout)


def _grpc_generate(cfg, max_tokens):
    """(gRPC status code, message) of a unary request through the ensemble (None: served)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from moepipe.validate.client import text_inputs

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{cfg.deploy.grpc_port}")
    inputs = []
    for name, value in text_inputs("It is a truth universally acknowledged", max_tokens).items():
        t = grpcclient.InferInput(name, list(value.shape), "BYTES" if value.dtype == object
                                  else "INT32")
        t.set_data_from_numpy(value)
        inputs.append(t)
    try:
        client.infer("ensemble", inputs, client_timeout=120)
        return None, None
    except InferenceServerException as e:
        return e.status(), e.message()
    finally:
        client.close()


def _group_up(cfg):
    url = f"http://127.0.0.1:{cfg.deploy.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("moepipe_rank_group_up{"):
                return float(line.rsplit(" ", 1)[1])
    return None


def _state(cfg):
    return json.loads((state_dir(cfg) / "server.json").read_text())


def _ranks_left(cfg):
    return [p for p in processes.deployment_processes(state_dir(cfg)) if p.kind == "rank"]


@contextlib.contextmanager
def _deployed(cfg, root):
    """``cfg`` built and deployed (supervised); everything of it gone at the end."""
    run_build(root / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    try:
        yield cfg
    finally:
        if (state_dir(cfg) / "server.json").is_file():
            lifecycle.stop(state_dir(cfg), grace=20)
        processes.kill_all(processes.deployment_processes(state_dir(cfg)))


@pytest.fixture
def group(tmp_path):
    # unary (not decoupled): a gRPC error carries its status code
    with _deployed(make_config(tmp_path, deploy={"max_restarts": 3, "decoupled": False}),
                   tmp_path) as cfg:
        yield cfg


def test_a_killed_worker_rank_ends_requests_with_unavailable_and_service_returns(group):
    cfg = group
    status, before = _generate(cfg)
    assert status == 200
    state = _state(cfg)
    worker = state["ranks"]["1"]
    assert processes.alive(worker) and _group_up(cfg) == 1
    # long requests in flight when the rank dies, over gRPC and HTTP
    answers = {}
    threads = [threading.Thread(target=lambda: answers.update(
                   grpc=_grpc_generate(cfg, max_tokens=400))),
               threading.Thread(target=lambda: answers.update(
                   http=_generate(cfg, max_tokens=400, timeout=120)))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a request in flight hung"
    ended = time.monotonic() - killed
    code, message = answers["grpc"]
    assert code == "StatusCode.UNAVAILABLE", answers
    assert message.startswith("in ensemble 'ensemble', rank group unavailable: "), message
    # Triton's HTTP frontend answers any error of /generate as 400
    assert answers["http"][0] in (400, 503), answers
    assert "rank group unavailable" in answers["http"][1]["error"], answers
    # the group's readiness is withdrawn at once; new requests are refused the same way
    assert _group_up(cfg) == 0 or processes.alive(_state(cfg)["ranks"]["1"])
    # the supervisor starts the rank group again; service returns with the same answer
    served = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, body = _generate(cfg, timeout=30)
        if status == 200:
            served = time.monotonic() - killed
            break
        assert status in (400, 503) and "rank group unavailable" in body["error"], body
        time.sleep(0.1)
    assert served is not None, "service did not return"
    assert body == before
    after = _state(cfg)
    assert after["restarts"] == 1 and after["pid"] == state["pid"]  # the server was kept
    assert after["ranks"]["1"] != worker and _group_up(cfg) == 1
    print(f"\nworker rank SIGKILLed: request in flight answered after {ended:.2f}s, "
          f"served again after {served:.2f}s")


def test_stop_leaves_no_rank_behind_even_during_a_rank_group_restart(group):
    cfg = group
    os.kill(_state(cfg)["ranks"]["1"], signal.SIGKILL)
    time.sleep(0.3)  # the supervisor is starting the workers again
    lifecycle.stop(state_dir(cfg), grace=20)
    assert not processes.deployment_processes(state_dir(cfg))
    assert not _ranks_left(cfg)


@pytest.fixture(scope="module")
def decoupled_group(tmp_path_factory):
    """The same group served decoupled (streaming, what the load jobs drive)."""
    root = tmp_path_factory.mktemp("decoupled-group")
    cfg = make_config(root, deploy={"max_restarts": 3},
                      validate={"max_tokens": 8,
                                "perf": {"concurrency": [2], "rates": [], "requests": 16,
                                         "duration_s": 20},
                                "recovery": {"kill": ["rank"], "rate": 4, "warmup_s": 1.5,
                                             "after_s": 1.0, "max_seconds": 30}})
    with _deployed(cfg, root):
        yield cfg


def test_perf_reports_the_communication_share_and_the_wait_for_the_slowest_rank(
        decoupled_group):
    from moepipe.commands.validate import endpoint_for, run_validate

    cfg = decoupled_group
    ep = endpoint_for(cfg, None, None)
    report, _ = run_validate(cfg, ep.http, ep.grpc, jobs=["perf"], echo=lambda s: None)
    point = report.jobs[0].data["points"][0]
    ranks = point["ranks"]
    assert ranks["world_size"] == 2 and set(ranks["ranks"]) == {"0", "1"}
    assert 0 < ranks["communication_share"] < 1
    assert ranks["wait_for_slowest_ms"] >= 0
    for r in ranks["ranks"].values():
        assert {"compute", "all_reduce", "all_gather"} <= set(r["by_op_ms"]), r
    print(f"\nperf, concurrency 2: communication share {ranks['communication_share']:.0%}, "
          f"wait for the slowest rank {ranks['wait_for_slowest_ms']} ms per step")


def test_the_recovery_job_kills_a_worker_rank_and_times_the_first_correct_answer(
        decoupled_group):
    from moepipe.commands.validate import endpoint_for, run_validate

    cfg = decoupled_group
    ep = endpoint_for(cfg, None, None)
    before = _state(cfg)
    report, _ = run_validate(cfg, ep.http, ep.grpc, jobs=["recovery"], echo=lambda s: None)
    job = report.jobs[0]
    assert report.passed, job.to_dict() if hasattr(job, "to_dict") else job
    run = job.data["runs"][0]
    assert run["kill"] == "rank" and run["pid"] == before["ranks"]["1"]
    assert run["readiness_withdrawn_after_s"] is not None  # the group's readiness fell
    assert run["time_to_first_correct_s"] is not None
    assert _state(cfg)["pid"] == before["pid"]  # the server kept running
    print(f"\nrecovery job (worker rank killed): readiness withdrawn after "
          f"{run['readiness_withdrawn_after_s']}s, ready after {run['time_to_ready_s']}s, "
          f"first correct answer after {run['time_to_first_correct_s']}s, "
          f"{run['requests_lost']} of {run['requests']} requests lost")
