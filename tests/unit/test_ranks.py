"""The rank group's pieces that run without processes: step descriptions, the control
channel's frames, the timings' arithmetic, what the deployment knows of its ranks."""

import json
import socket

import pytest
import torch

from moepipe.ranks.channel import Channel, ChannelClosed, Kind
from moepipe.ranks.steps import Op, Step
from moepipe.ranks.timings import GroupTimings, StepTiming
from moepipe.runtime.batch import Batch


def test_a_step_description_round_trips():
    batch = Batch(torch.tensor([5, 6, 7, 8, 9]), [3, 1, 1], [0, 7, 12], [2, 0, 5])
    got = Step.decode(Step(Op.FORWARD, 41, batch, True).encode())
    assert (got.op, got.number, got.all_logits) == (Op.FORWARD, 41, True)
    assert got.batch is not None and got.batch.tokens.tolist() == [5, 6, 7, 8, 9]
    assert (got.batch.seq_lens, got.batch.past_lens, got.batch.slots) == \
        ([3, 1, 1], [0, 7, 12], [2, 0, 5])
    assert Step.decode(Step(Op.STOP).encode()).op == Op.STOP
    # a live update: the version a forward runs on, and what a STAGE loads
    assert Step.decode(Step(Op.FORWARD, 3, batch, weights=2).encode()).weights == 2
    stage = Step.decode(Step(Op.STAGE, weights=5, detail='{"checkpoint": "/c"}').encode())
    assert (stage.op, stage.weights, stage.detail) == (Op.STAGE, 5, '{"checkpoint": "/c"}')


def test_frames_cross_a_socket_and_an_end_is_seen():
    a, b = socket.socketpair()
    left, right = Channel(a), Channel(b)
    left.send_json(Kind.HELLO, {"rank": 3})
    left.send(Kind.STEP, b"\x01" * 70_000)  # larger than one recv
    assert right.recv_json(Kind.HELLO) == {"rank": 3}
    assert right.recv() == (Kind.STEP, b"\x01" * 70_000)
    left.send_json(Kind.REFUSED, {"why": "rank 3 is already taken"})
    with pytest.raises(ChannelClosed, match="already taken"):
        right.recv_json(Kind.SETUP)
    left.close()
    with pytest.raises(ChannelClosed):
        right.recv()


def test_the_wait_for_the_slowest_rank():
    """Rank 1 computed longer, so rank 0 waited in the all-reduce: the least collective time
    of a step is the transfer, the rest of each rank's is waiting."""
    t = GroupTimings(2)
    t.add(StepTiming(0, 1, {"compute": 0.010, "all_reduce": 0.007, "control": 0.001}))
    assert t.steps == 0 and not t.drain()  # rank 1's timing is not in yet
    t.add(StepTiming(1, 1, {"compute": 0.016, "all_reduce": 0.002}))
    assert t.steps == 1
    seen = {(rank, op): round(s, 6) for rank, op, s in t.drain()}
    assert seen[(0, "wait")] == 0.006 and seen[(1, "wait")] == 0.0
    assert seen[(1, "compute")] == 0.016
    assert t.drain() == []
    # a lost rank's half-reported steps are dropped, not kept forever
    for step in range(2, 400):
        t.add(StepTiming(0, step, {"compute": 0.001}))
    assert len(t._pending) <= 256


def test_timings_travel_as_json():
    t = StepTiming(2, 9, {"compute": 0.5, "recv": 0.25}, experts=[[1, 0, 3]])
    back = StepTiming.from_json(json.loads(json.dumps(t.to_json())))
    assert back == t and back.comm == 0.25 and back.total == 0.75


def test_the_deployment_finds_its_ranks(tmp_path):
    """The rendered values say whether the model is rank 0 of a group; the worker module's
    name is what /proc shows."""
    from moepipe.deploy.local import processes
    from moepipe.deploy.local.ranks import MANIFEST, RankGroup
    from moepipe.ranks import worker

    assert processes.RANK_MODULE == worker.MODULE
    repo = tmp_path / "model_repo"
    repo.mkdir()
    assert RankGroup.of(repo) is None
    values = {"world_size": "4", "rank_listen": "127.0.0.1:9003", "checkpoint_dir": "/ck",
              "rank_form_timeout_s": "30"}
    (tmp_path / MANIFEST).write_text(json.dumps({"values": values}))
    assert RankGroup.of(repo) == RankGroup(4, "127.0.0.1:9003", "/ck", 30.0)
    (tmp_path / MANIFEST).write_text(json.dumps({"values": {**values, "world_size": "1"}}))
    assert RankGroup.of(repo) is None


def test_the_rank_port_is_a_port_of_its_own():
    from moepipe.config import parse_config

    data = {"model": {"example": "tiny-mixtral"}, "deploy": {"rank_port": 8001}}
    with pytest.raises(Exception, match="rank_port must differ"):
        parse_config(data, "moepipe.yaml", json.dumps(data))


METRICS = """# TYPE moepipe_rank_step_seconds histogram
moepipe_rank_step_seconds_sum{model="tensorrt_llm",op="compute",rank="0"} 1.0
moepipe_rank_step_seconds_count{model="tensorrt_llm",op="compute",rank="0"} 10
moepipe_rank_step_seconds_sum{model="tensorrt_llm",op="all_reduce",rank="0"} 1.5
moepipe_rank_step_seconds_count{model="tensorrt_llm",op="all_reduce",rank="0"} 10
moepipe_rank_step_seconds_sum{model="tensorrt_llm",op="compute",rank="1"} 2.0
moepipe_rank_step_seconds_count{model="tensorrt_llm",op="compute",rank="1"} 10
moepipe_rank_step_seconds_sum{model="tensorrt_llm",op="all_reduce",rank="1"} 0.5
moepipe_rank_step_seconds_count{model="tensorrt_llm",op="all_reduce",rank="1"} 10
moepipe_rank_wait_seconds_sum{model="tensorrt_llm",rank="0"} 1.0
moepipe_rank_wait_seconds_sum{model="tensorrt_llm",rank="1"} 0.0
moepipe_rank_group_up{model="tensorrt_llm"} 1
"""


def test_the_perf_report_reads_the_rank_metrics():
    """Communication share and the wait for the slowest rank between two scrapes."""
    from moepipe.deploy.metric_names import rank_series
    from moepipe.validate.rank_figures import share

    after = rank_series(METRICS)
    assert after[("up", -1, "")] == 1 and after[("step_sum", 1, "compute")] == 2.0
    got = share({}, after)
    assert got is not None
    assert got["communication_share"] == 0.4  # (1.5 + 0.5) / 5
    assert got["ranks"]["0"]["communication_share"] == 0.6
    assert got["ranks"]["0"]["wait_ms"] == 100.0 and got["wait_for_slowest_ms"] == 100.0
    assert got["step_ms"] == 250.0
    assert share(after, after) is None  # no step in between
    assert share({}, rank_series("")) is None  # a single process: no figures
