"""One tritonserver command line (moepipe.deploy.tritonserver.ServerCommand) for every way a
target's server runs, and each target's exported-metrics list held against those flags.

What Triton reports for which flags is upstream's (tests/triton_metrics.py cites the files).
The dashboards and alert rules are held against each target's list in turn.
"""

import shlex
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from triton_metrics import FIRST_RESPONSE, SUMMARIES, triton_part, triton_reports

from moepipe.config import parse_config
from moepipe.deploy.cluster import grafana
from moepipe.deploy.cluster.operate import RULES_FILE, render_operations
from moepipe.deploy.metric_names import exported, metrics_in
from moepipe.deploy.render.targets import Artifacts
from moepipe.targets import TARGETS

VERSION = "0123456789ab"  # the build version the pods serve (a fingerprint's 12 hex digits)


def make_cfg(tmp_path: Path, target: str, **parallel):
    data = {"model": {"example": "tiny-mixtral"}, "target": target,
            "parallel": parallel or {"tp": 2}, "workdir": str(tmp_path / "work")}
    return parse_config(data, "moepipe.yaml").resolve_paths(tmp_path)


def pod_args(tmp_path: Path, target: str) -> list[str]:
    """The flags of the serving container of the rendered Deployment (world size 1 on a CPU
    target: more is a rank group, one pod per rank)."""
    cfg = make_cfg(tmp_path, target, **({} if TARGETS[target].gpu else {"tp": 1}))
    out = tmp_path / "deploy"
    out.mkdir(parents=True)
    render_operations(cfg, out, version=VERSION)
    (deployment,) = yaml.safe_load_all((out / "k8s" / "release" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    shell, flag, script, name, *args = container["command"]
    return args


def rank_group_leader(tmp_path: Path, target: str) -> list[str]:
    """The flags the leader pod of a CPU rank group (leader.sh) starts its server with."""
    cfg = make_cfg(tmp_path, target, tp=2)
    out = tmp_path / "deploy"
    out.mkdir(parents=True)
    render_operations(cfg, out, version=VERSION)
    (cm,) = yaml.safe_load_all((out / "k8s" / "release" / "launch-configmap.yaml").read_text())
    (line,) = [x for x in cm["data"]["leader.sh"].splitlines()
               if x.startswith("exec tritonserver ")]
    return shlex.split(line)[2:]


def leader_ranks(tmp_path: Path) -> list[list[str]]:
    """Every rank's words as the rendered LeaderWorkerSet leader script builds them for mpirun
    (its rank loop run by /bin/sh)."""
    cfg = make_cfg(tmp_path, "trtllm-engine", tp=8, pp=2)
    out = tmp_path / "deploy"
    out.mkdir(parents=True)
    render_operations(cfg, out, version=VERSION)
    (cm,) = yaml.safe_load_all((out / "k8s" / "release" / "launch-configmap.yaml").read_text())
    lines = cm["data"]["leader.sh"].splitlines()
    start = lines.index("set --")
    loop = "\n".join(lines[start:lines.index("done", start) + 1])
    words = subprocess.run(["/bin/sh", "-c", loop + '\nprintf "%s\\n" "$@"'], check=True,
                           capture_output=True, text=True, timeout=30).stdout.splitlines()
    ranks, current = [], []
    for word in words:
        if word == ":":
            ranks.append(current)
            current = []
        else:
            current.append(word)
    return [*ranks, current]


def local_args(tmp_path: Path, monkeypatch) -> list[str]:
    """The flags `moepipe deploy` starts the local server with (lifecycle.start, up to the
    moment it would spawn the process)."""
    from moepipe.deploy.local import lifecycle
    from moepipe.deploy.local.lifecycle import subprocess as spawned

    seen: list[list[str]] = []

    class Spawned(Exception):
        pass

    def popen(cmd, **kwargs):
        seen.append(cmd)
        raise Spawned

    monkeypatch.setattr(spawned, "Popen", popen)
    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    http, grpc, metrics = (s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    with pytest.raises(Spawned):
        lifecycle.start(tmp_path / "model_repo", tmp_path / "state", host="127.0.0.1",
                        http_port=http, grpc_port=grpc, metrics_port=metrics,
                        binary=Path("/bin/true"))
    (cmd,) = seen
    return cmd[1:]


def commands(tmp_path: Path, monkeypatch, target: str) -> dict[str, tuple[list[str], bool]]:
    """way of running -> (the server's flags, whether that machine has GPUs)."""
    t = TARGETS[target]
    out = {"pod": (pod_args(tmp_path / "pod", target), t.gpu)}
    if not t.gpu:  # `moepipe deploy` starts it here
        out["local"] = (local_args(tmp_path / "local", monkeypatch), False)
    if t.multi_node and not t.mpi_ranks:
        out["rank group leader"] = (rank_group_leader(tmp_path / "group", target), t.gpu)
    if t.multi_node and t.mpi_ranks:
        ranks = leader_ranks(tmp_path / "leader")
        out["leader rank 0"] = (ranks[0][3:], True)  # after -n 1 tritonserver
    if t.gpu and not t.mpi_ranks:  # the command `moepipe deploy` prints
        from moepipe.commands.deploy import _gpu_instructions

        cfg = make_cfg(tmp_path / "printed", target)
        text = _gpu_instructions(cfg, Artifacts(version="0123456789ab", model_dir=tmp_path), cfg.deploy_dir / "mr")
        (line,) = [s for s in text.splitlines() if "in the container: tritonserver" in s]
        out["printed"] = (shlex.split(line.split("in the container: ", 1)[1])[1:], True)
    return out


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_server_of_a_target_exports_the_triton_metrics_it_declares(tmp_path,
                                                                        monkeypatch, target):
    declared = triton_part(exported(target))
    for way, (args, gpus) in commands(tmp_path, monkeypatch, target).items():
        missing = declared - triton_reports(args, gpus=gpus)
        assert not missing, f"{target} ({way}): declared but not produced: {sorted(missing)}"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_ways_a_target_runs_differ_only_in_where_they_listen(tmp_path, monkeypatch,
                                                                   target):
    """Addresses and ports (the local test server takes free ports), the repository's path,
    the local server's backend folder and an MPI rank's shared-memory prefix aside, every way
    a target's server runs gets the same flags."""
    seen = {}
    for way, (args, _) in commands(tmp_path, monkeypatch, target).items():
        seen[way] = sorted(a for a in args if not a.startswith(
            ("--model-repository=", "--http-", "--grpc-", "--metrics-address=",
             "--metrics-port=", "--backend-directory=",
             "--backend-config=python,shm-region-prefix-name=")))
    assert len({tuple(v) for v in seen.values()}) == 1, seen


def test_mpi_ranks_of_the_leader_follow_tensorrt_llm_launch_triton_server(tmp_path):
    """TensorRT-LLM triton_backend/scripts/launch_triton_server.py: every rank the same server
    flags and its own shm-region prefix; ranks > 0 --model-control-mode=explicit
    --load-model=tensorrt_llm."""
    ranks = leader_ranks(tmp_path)
    assert len(ranks) == 16
    rank0 = ranks[0][3:]
    for i, words in enumerate(ranks):
        assert words[:3] == ["-n", "1", "tritonserver"]
        extra = [w for w in words[3:] if w not in rank0]
        shm = f"--backend-config=python,shm-region-prefix-name=prefix{i}_"
        assert shm in words
        want = [shm, "--model-control-mode=explicit", "--load-model=tensorrt_llm"] if i else []
        assert extra == want


def test_without_the_flags_the_declared_summaries_would_not_exist():
    """The bug this holds against: launch.sh started the engine's ranks without
    --metrics-config, so the summaries the p99 alert reads never existed."""
    assert SUMMARIES <= triton_part(exported("trtllm-engine"))
    assert not SUMMARIES & triton_reports(["--model-repository=/r"], gpus=True)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_rules_and_dashboard_read_only_what_the_target_exports(tmp_path, target):
    cfg = make_cfg(tmp_path, target)
    out = tmp_path / "deploy"
    out.mkdir(parents=True)
    render_operations(cfg, out, version=VERSION)
    names = exported(target)
    rules = yaml.safe_load((out / "monitoring" / RULES_FILE).read_text())["groups"][0]["rules"]
    available = set(names)
    for rule in rules:
        assert metrics_in(rule["expr"]) <= available, (target, rule)
        available.add(rule.get("record", ""))
    alerts = {r["alert"] for r in rules if "alert" in r}
    # every target exports Triton's summaries: the p99 latency alert is there for each
    assert {"MoepipeLatencyP99High", "MoepipeErrorRatioHigh", "MoepipeServerDown"} <= alerts
    assert ("MoepipeExpertImbalance" in alerts) == ("moepipe_expert_tokens_total" in names)
    titles = {p.title for p in grafana.panels_for(target)}
    assert "Latency percentiles" in titles
    assert ("Time to first token (p50 / p99)" in titles) == \
        (triton_part(names) >= FIRST_RESPONSE)


def test_not_decoupled_deployments_lose_the_first_response_histogram():
    """Triton reports it for decoupled models only (InitializeHistograms)."""
    for target in TARGETS:
        assert not FIRST_RESPONSE & exported(target, decoupled=False)
        assert not any("first_response" in e for p in grafana.panels_for(target,
                                                                          decoupled=False)
                       for e, _ in p.queries)
