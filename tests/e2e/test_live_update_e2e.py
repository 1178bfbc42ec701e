"""`moepipe deploy` against a running cpu deployment (a real tritonserver) while clients send
requests without pause (issue 23, items 1-4):

* a re-trained expert subset is swapped in place: no request fails, every answer is entirely
  the old version's or entirely the new version's tokens (none mixed), the answers after the
  switch are the new version's, only the changed tensors are read;
* the serving version is in `moepipe status --json`, the metrics and the validate report;
* a broken build fails its validation through the live server: the deploy exits non-zero with
  the reason and the old version keeps serving;
* `--rollback` returns to the version before, validated the same way;
* a change beyond the weights restarts the server and says so in one line;
* a rank group (two processes) stages each rank's own part and switches together; a worker
  restarted after the switch joins on the new version.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import yaml
from helpers import make_config
from live_load import Load, longest_gap
from retrained import retrain_experts

from moepipe.checkpoints.reader import parse_header
from moepipe.commands.build import run_build
from moepipe.commands.deploy import artifacts, run_deploy, state_dir
from moepipe.commands.update import UpdateRejected
from moepipe.commands.validate import endpoint_for, run_validate
from moepipe.config import load_config
from moepipe.deploy.local import lifecycle
from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.generate import generate
from moepipe.runtime.model import ReferenceModel
from moepipe.validate import client

PROMPTS = [[1, 5, 9, 2, 7], [30, 31, 2, 8], [11, 3, 250, 4, 4, 9], [7, 7, 100]]
MAX_TOKENS = 16


def _use(workdir, source, **deploy):
    """The workdir's config pointing at ``source`` (the user edits moepipe.yaml)."""
    path = workdir / "moepipe.yaml"
    data = yaml.safe_load(path.read_text())
    data["model"] = {"path": str(source)}
    data["deploy"].update(deploy)
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def _build(cfg):
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    art = artifacts(cfg)
    model = ReferenceModel(load_checkpoint(art.checkpoint_dir))
    return art, [generate(model, [p], MAX_TOKENS)[0] for p in PROMPTS]


def _metric_versions(cfg):
    with urllib.request.urlopen(f"http://{cfg.deploy.host}:{cfg.deploy.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    return {line.split('version="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("moepipe_model_info{")}


def _cli_status(cfg):
    out = subprocess.run([sys.executable, "-m", "moepipe", "status", "-c",
                          str(cfg.workdir / "moepipe.yaml"), "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def _corrupt_changed_tensor(checkpoint):
    """Flip a re-trained tensor's sign in place, keeping the file's size and mtime: a build
    damaged after it was recorded, which only the validation can catch."""
    path = checkpoint / "rank0.safetensors"
    info = parse_header(path)["transformer.layers.0.mlp.fc.weight"]
    st = path.stat()
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(info.offset)
        data = bytearray(f.read(info.nbytes))
        for i in range(3, len(data), 4):  # float32 little-endian: the sign bit
            data[i] ^= 0x80
        f.seek(info.offset)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _answered(load, n=6, timeout=60):
    """Wait until the clients have had ``n`` answers (a loaded machine's first requests can
    take seconds): the update then starts under load, with answers before it."""
    deadline = time.monotonic() + timeout
    while len(load.answers) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(load.answers) >= n, "the clients got no answers before the update"


@pytest.fixture(scope="module")
def sources(examples, tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    v1 = examples["tiny-mixtral"]
    return {"v1": v1,
            "v2": retrain_experts(v1, root / "v2", layer=0, experts=(1,), seed=1),
            "bad": retrain_experts(v1, root / "bad", layer=0, experts=(2,), seed=2)}


def test_live_update_under_load(sources, tmp_path):
    workdir = tmp_path / "work"
    make_config(workdir, parallel={"tp": 1, "moe_ep": 1}, validate={"max_tokens": 8})
    cfg1 = _use(workdir, sources["v1"])
    art1, want1 = _build(cfg1)
    run_deploy(cfg1, echo=lambda s: None)
    try:
        assert _cli_status(cfg1)["version"] == art1.version
        assert _metric_versions(cfg1) == {art1.version: 1.0}
        cfg2 = _use(workdir, sources["v2"])
        art2, want2 = _build(cfg2)
        assert want1 != want2  # the re-trained expert changes the answers
        ep = endpoint_for(cfg1, None, None)
        load = Load(ep.grpc, PROMPTS, MAX_TOKENS, clients=3).start()
        _answered(load)
        lines: list[str] = []
        began = time.monotonic()
        result = run_deploy(cfg2, echo=lines.append)
        switched = time.monotonic()
        time.sleep(2)
        answers = load.stop()

        assert result["updated"] and result["previous"] == art1.version
        assert result["version"] == art2.version
        # expert 1 of layer 0: the fc and proj of layer 0's experts, nothing else
        assert result["changed_tensors"] == 2 and result["total_tensors"] > 20
        assert any("2 of" in line and "tensors changed" in line for line in lines), lines
        # no request failed; each answer is wholly one version's; after the switch, the new
        failed = [a for a in answers if a.tokens is None]
        assert failed == [], failed[:3]
        for a in answers:
            assert a.tokens in (want1[a.prompt], want2[a.prompt]), a
        later = [a for a in answers if a.started > switched]
        assert later and all(a.tokens == want2[a.prompt] for a in later)
        earlier = [a for a in answers if a.ended < began]
        assert earlier and all(a.tokens == want1[a.prompt] for a in earlier)
        print(f"\nlive update: {len(answers)} answers, longest gap "
              f"{longest_gap(answers, began, switched):.2f}s, {result['serving_s']:.1f}s to "
              f"serve, {result['extra_bytes']} extra bytes")

        # visible: status, metrics, validate reports
        assert _cli_status(cfg2)["version"] == art2.version
        assert _metric_versions(cfg2) in ({art2.version: 1.0},
                                          {art2.version: 1.0, art1.version: 0.0})
        report, _ = run_validate(cfg2, jobs=["smoke"], echo=lambda s: None)
        assert report.passed and report.to_dict()["version"] == art2.version

        # a broken build is refused by its validation; the serving version stays
        cfg3 = _use(workdir, sources["bad"])
        art3, _ = _build(cfg3)
        _corrupt_changed_tensor(art3.checkpoint_dir)
        load = Load(ep.grpc, PROMPTS, MAX_TOKENS, clients=2).start()
        with pytest.raises(UpdateRejected, match="failed its validation.*accuracy") as e:
            run_deploy(cfg3, echo=lambda s: None)
        answers = load.stop()
        assert f"version {art2.version} keeps serving" in e.value.message
        assert [a for a in answers if a.tokens is None] == []
        assert all(a.tokens == want2[a.prompt] for a in answers)
        assert _cli_status(cfg2)["version"] == art2.version

        # --rollback returns to v1 the same way (validated against v1's source)
        lines = []
        result = run_deploy(cfg2, echo=lines.append, rollback=True)
        assert result["updated"] and result["version"] == art1.version, lines
        assert _cli_status(cfg2)["version"] == art1.version

        # anything beyond the weights restarts the server, in one line
        cfg4 = _use(workdir, sources["v1"], max_queue_size=4)
        lines = []
        run_deploy(cfg4, echo=lines.append)
        restart = [line for line in lines if "restarting the server" in line]
        assert restart == ["deploy: deployment settings changed (max_queue_size: "
                           f"{cfg1.deploy.max_queue_size} -> 4): restarting the server "
                           "(requests in flight end)"], lines
        assert _cli_status(cfg4)["version"] == art1.version
    finally:
        lifecycle.stop(state_dir(cfg1), grace=40)


def _answer(ep, prompt):
    """Greedy tokens of one request, or None while the rank group is being formed again."""
    try:
        res = client.grpc_infer(ep.grpc, "tensorrt_llm", {
            "input_ids": np.array([prompt], np.int32),
            "input_lengths": np.array([[len(prompt)]], np.int32),
            "request_output_len": np.array([[MAX_TOKENS]], np.int32),
            "exclude_input_in_output": np.array([[True]], np.bool_)},
            ["output_ids", "sequence_length"], 30)
    except client.ClientError:
        return None
    out = res.outputs[-1]
    return out["output_ids"].reshape(-1)[: int(out["sequence_length"].reshape(-1)[0])].tolist()


def test_a_rank_group_updates_every_rank_and_a_restarted_rank_serves_the_new_version(
        sources, tmp_path):
    """tp=2, moe_ep=2 as two processes: each rank stages its own changed tensors (expert 1 of
    layer 0 lives on rank 0: the worker reads nothing), every step runs both ranks on one
    version; a worker killed after the switch comes back on the new version."""
    workdir = tmp_path / "work"
    make_config(workdir, parallel={"tp": 2, "moe_ep": 2}, deploy={"max_restarts": 3},
                validate={"max_tokens": 8})
    cfg1 = _use(workdir, sources["v1"])
    art1, want1 = _build(cfg1)
    run_deploy(cfg1, echo=lambda s: None)
    try:
        cfg2 = _use(workdir, sources["v2"])
        art2, want2 = _build(cfg2)
        ep = endpoint_for(cfg1, None, None)
        load = Load(ep.grpc, PROMPTS, MAX_TOKENS, clients=3).start()
        _answered(load)
        result = run_deploy(cfg2, echo=lambda s: None)
        switched = time.monotonic()
        time.sleep(2)
        answers = load.stop()
        assert result["updated"] and result["version"] == art2.version
        assert result["changed_tensors"] == 2  # rank 0's; the worker's file did not change
        assert [a for a in answers if a.tokens is None] == []
        for a in answers:
            assert a.tokens in (want1[a.prompt], want2[a.prompt]), a
        later = [a for a in answers if a.started > switched]
        assert later and all(a.tokens == want2[a.prompt] for a in later)
        # the supervisor's new worker joins on the version serving now
        worker = _cli_status(cfg2)["ranks"]["1"]
        os.kill(worker, signal.SIGKILL)
        deadline, got = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            got = _answer(ep, PROMPTS[0])
            if got is not None and _cli_status(cfg2)["ranks"]["1"] != worker:
                break
            time.sleep(0.2)
        assert got == want2[0]
        assert [_answer(ep, p) for p in PROMPTS] == want2
        assert _cli_status(cfg2)["version"] == art2.version
    finally:
        lifecycle.stop(state_dir(cfg1), grace=40)
