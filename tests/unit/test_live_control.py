"""The live-update channel of a serving engine (``moepipe.serving.live`` over a Unix socket,
``moepipe.deploy.local.live`` from outside): stage, validate on pinned requests, switch,
release, discard, refusals; a rank process updates its own rank only; the serving version as
the metrics and a request's parameters carry it."""

import threading

import pytest

from moepipe.checkpoints.manifest import diff_checkpoints
from moepipe.deploy.local import live as outside
from moepipe.deploy.local.state import CONTROL_SOCKET, ServerError
from moepipe.deploy.metric_names import serving_version
from moepipe.ranks.gloo import GlooComm
from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.generate import generate
from moepipe.runtime.model import ReferenceModel
from moepipe.runtime.update import load_update
from moepipe.serving.batcher import Batcher
from moepipe.serving.live import LiveUpdates, start_control
from moepipe.serving.request import GenerationRequest, RequestError
from moepipe.serving.versions import VERSION_PARAMETER, requested_version

PROMPT = [1, 5, 9, 2, 7]


@pytest.fixture(scope="module")
def builds(live_builds):
    return live_builds


def _greedy(engine, n, version=None):
    done, out = threading.Event(), {}

    def tokens(t, lp, final):
        out["tokens"] = t
        if final:
            done.set()

    def error(message):
        out["error"] = message
        done.set()

    engine.submit(GenerationRequest(prompt=PROMPT, max_new_tokens=n, weights_version=version,
                                    on_tokens=tokens, on_error=error))
    assert done.wait(30)
    if "error" in out:
        raise AssertionError(out["error"])
    return out["tokens"]


def test_stage_validate_switch_release_over_the_socket(builds, tmp_path):
    current = ReferenceModel(load_checkpoint(builds["old"]))
    want_old = generate(current, [PROMPT], 8)[0]
    want_new = generate(ReferenceModel(load_checkpoint(builds["new"])), [PROMPT], 8)[0]
    assert want_old != want_new
    engine = Batcher(current, max_batch_size=4, max_seq_len=64, version="v1")
    engine.start()
    # a state folder deeper than a socket path may be (107 bytes): reached all the same
    state = tmp_path / ("d" * 60) / ("e" * 60)
    switched = []
    control = start_control(str(state / CONTROL_SOCKET), LiveUpdates(
        engine, builds["old"], on_switch=lambda old, new: switched.append((old, new))))
    assert control is not None
    try:
        assert (state / CONTROL_SOCKET).stat().st_mode & 0o777 == 0o600  # the owner only
        assert outside.serving_version(state) == "v1"
        staged = outside.ask(state, {"op": "stage", "version": "v2",
                                     "checkpoint": str(builds["new"])}, timeout=60)
        assert staged["changed_tensors"] == 2 and not staged["by_file"]
        assert 0 < staged["read_bytes"] <= staged["extra_bytes"]
        # validation requests name the staged version; the others still get the serving one
        assert _greedy(engine, 8, "v2") == want_new
        assert _greedy(engine, 8) == want_old
        assert outside.ask(state, {"op": "status"})["staged"] == ["v2"]
        switch = outside.ask(state, {"op": "switch", "version": "v2"})
        assert switch["previous"] == "v1" and switched == [("v1", "v2")]
        assert _greedy(engine, 8) == want_new
        assert outside.ask(state, {"op": "released", "version": "v1", "timeout_s": 5}
                           )["released"]
        # a discarded candidate is gone; the serving version stays
        outside.ask(state, {"op": "stage", "version": "v3", "checkpoint": str(builds["old"])},
                    timeout=60)
        assert outside.ask(state, {"op": "discard", "version": "v3"})["discarded"]
        with pytest.raises(RequestError, match="'v3' is not loaded"):
            _greedy(engine, 2, "v3")
        assert outside.serving_version(state) == "v2"
        # refusals carry the model's reason
        with pytest.raises(ServerError, match="not the same model"):
            outside.ask(state, {"op": "stage", "version": "v4",
                                "checkpoint": str(builds["old-ep"])}, timeout=60)
        with pytest.raises(ServerError, match="unknown command 'reboot'"):
            outside.ask(state, {"op": "reboot"})
    finally:
        control.close()
        engine.stop()
    # nobody listens any more: the caller restarts instead
    with pytest.raises(outside.Unreachable, match="does not answer"):
        outside.ask(state, {"op": "status"})


def test_a_second_server_does_not_take_a_live_socket(builds, tmp_path):
    engine = Batcher(ReferenceModel(load_checkpoint(builds["old"])), max_batch_size=1,
                     max_seq_len=32, version="v1")
    path = str(tmp_path / CONTROL_SOCKET)
    first = start_control(path, LiveUpdates(engine, builds["old"]))
    try:
        assert start_control(path, LiveUpdates(engine, builds["old"])) is None
    finally:
        first.close()
    again = start_control(path, LiveUpdates(engine, builds["old"]))  # a stale file is replaced
    assert again is not None
    again.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_process_reads_its_own_changed_tensors(builds, rank):
    """At moe_ep=2 expert 1 of layer 0 lives on rank 0: rank 0 reads its two changed
    tensors, rank 1 reads nothing and shares every tensor."""
    old = load_checkpoint(builds["old-ep"], ranks=[rank])
    current = ReferenceModel(old, comm=GlooComm(rank, old.mapping))  # not joined: no step runs
    update = load_update(current, builds["new-ep"])
    diff = diff_checkpoints(builds["old-ep"], builds["new-ep"], 2, [0, 1])
    assert sorted(update.model.ckpt.ranks) == [rank] and update.model.comm is current.comm
    assert update.diff.changed_tensors == len(diff.ranks[rank].changed)
    assert update.read_bytes == sum(old.ranks[rank][n].nbytes
                                    for n in diff.ranks[rank].changed)
    assert (update.read_bytes > 0) == (rank == 0)
    fresh = load_checkpoint(builds["new-ep"], ranks=[rank]).ranks[rank]
    for name, t in update.model.ckpt.ranks[rank].items():
        assert t.equal(fresh[name]), name


def test_the_serving_version_in_the_metrics():
    text = ('# TYPE moepipe_model_info gauge\n'
            'moepipe_model_info{model="tensorrt_llm",version="aaa111"} 0\n'
            'moepipe_model_info{model="tensorrt_llm",version="bbb222"} 1\n')
    assert serving_version(text) == "bbb222"
    assert serving_version("nv_inference_count 3\n") is None


def test_a_request_names_its_version_as_a_string():
    assert requested_version({}) is None
    assert requested_version({VERSION_PARAMETER: "abc"}) == "abc"
    with pytest.raises(RequestError, match="must be a string"):
        requested_version({VERSION_PARAMETER: 3})
