"""Stage ``deploy``: render the target's deployment folder; for ``cpu`` start a local Triton."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from moepipe.config import MoepipeConfig, load_config
from moepipe.deploy.cluster import rollout
from moepipe.deploy.local import lifecycle
from moepipe.deploy.local.ranks import MANIFEST
from moepipe.deploy.render.repository import Artifacts, render_deployment
from moepipe.deploy.serve_paths import RELEASES, ServePaths, release_dir
from moepipe.deploy.tritonserver import ServerCommand
from moepipe.errors import MoepipeError
from moepipe.targets import get_target


def state_dir(cfg: MoepipeConfig) -> Path:
    """Where the config's local deployment is recorded."""
    from moepipe.deploy.local.state import state_dir as local_state_dir

    return local_state_dir(cfg.workdir)


def artifacts(cfg: MoepipeConfig) -> Artifacts:
    """What the last `moepipe build` of this workdir produced."""
    from moepipe.commands.build import model_dir, outputs, served_version
    from moepipe.stages.registry import STAGES
    from moepipe.utils.fs import read_json

    # GPU targets render before their GPU stages ran (the engine is built on the GPU machine).
    gpu_stages = tuple(s.name for s in STAGES if s.gpu)
    built = outputs(cfg, optional=gpu_stages if get_target(cfg.target).gpu else ())
    model = model_dir(cfg)
    ckpt = built.get("convert")
    serving = built.get("quantize") or model
    vocab = read_json((ckpt or serving) / "config.json", "the checkpoint")["vocab_size"]
    return Artifacts(model_dir=model, checkpoint_dir=ckpt, engine_dir=built.get("engine"),
                     hf_serving_dir=serving, vocab_size=int(vocab), version=served_version(cfg))


def _gpu_instructions(cfg: MoepipeConfig, art: Artifacts, repo: Path) -> str:
    from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER

    paths = ServePaths.of(cfg)  # as it is where it will be served
    out = Path(paths.absolute(paths.deploy_dir, "deploy.output"))
    lines = [f"deploy: the {cfg.target} target runs on NVIDIA GPUs inside "
             f"{TRITON_TRTLLM_CONTAINER} (TensorRT-LLM is not installed here), so no server "
             "was started."]
    target = get_target(cfg.target)
    if target.artifact == "engine" and art.engine_dir is None:
        lines.append(f"  the engine is not built yet: run `moepipe build` on the GPU "
                     f"machine (it writes {cfg.workdir / 'engine'})")
    if target.mpi_ranks:  # the rendered launcher starts the ranks with the server's flags
        lines.append(f"  then, in the container: bash {out / 'launch.sh'}  (one MPI rank per "
                     "GPU; it checks the engine's world size, the GPUs and the TensorRT-LLM "
                     "version before starting)")
    else:
        server = ServerCommand.of(cfg, Path(paths.repository()))
        env = ""
        window = cfg.deploy.trtllm.expert_statistic
        if window is not None:  # TensorRT-LLM's workers read it from the server's environment
            from moepipe.trtllm.expert_statistic import environment

            where = paths.absolute(cfg.expert_statistic_dir, "the expert statistics")
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in environment(
                window.start, window.stop, where).items()) + " "
        lines.append(f"  in the container: {env}{shlex.join(['tritonserver', *server.args()])}")
    lines.append("  then: moepipe validate --url HOST:PORT --grpc-url HOST:PORT")
    lines += kubernetes_steps(cfg)
    return "\n".join(lines)


class RolloutStopped(MoepipeError):
    """The rollout stopped before its switch or while draining (not ready, validation failed,
    the budget allowed nothing): the release that served keeps serving."""

    exit_code = 1


def kubernetes_steps(cfg: MoepipeConfig) -> list[str]:
    """How the rendered Kubernetes folder is installed, and replaced blue/green."""
    k8s = cfg.deploy_dir / "k8s"
    return [f"  Kubernetes: a first install is `kubectl apply -k {k8s}`; a new version beside a "
            f"running one: `moepipe deploy --rollout` (runs {k8s / rollout.SCRIPT}: the new "
            "release comes up beside the serving one, its validate Job passes, the Service "
            "moves to it, the old release drains one pod at a time)"]


def run_rollout(cfg: MoepipeConfig, echo: Callable[[str], None],
                rollback: bool = False) -> dict:
    """Render the config's build and roll it out blue/green to the current kubectl context
    (``k8s/rollout.sh``); ``rollback``: roll out the release before the one rendered last
    again (its folder in ``<deploy>/releases``)."""
    kubectl = os.environ.get("KUBECTL", "kubectl")
    if shutil.which(kubectl) is None:
        raise MoepipeError(f"--rollout runs kubectl, and {kubectl!r} is not on PATH",
                           "install kubectl (or set KUBECTL) and select the cluster's context")
    if rollback:
        release = _previous_release(cfg)
        script = release_dir(cfg, release) / "k8s" / rollout.SCRIPT
    else:
        lifecycle.refuse_served(repository_dir(cfg))  # before rendering over its files
        art = artifacts(cfg)
        render_deployment(cfg, art)
        release, script = art.version, cfg.deploy_dir / "k8s" / rollout.SCRIPT
    echo(f"deploy: rolling out release {release} with {script}")
    # the script's steps (and kubectl's lines) go to stderr as they happen; a stop is the last
    with subprocess.Popen(["/bin/sh", str(script)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.strip():
                lines.append(line.rstrip("\n"))
    if proc.returncode != 0:
        last = lines[-1:] or ["(no output)"]
        raise RolloutStopped(f"the rollout of release {release} stopped: "
                           f"{last[0].removeprefix('rollout: error: ')}",
                           "the release that served before keeps its traffic; see the steps "
                           "above")
    return {"release": release, "rolled_out": True, "script": str(script)}


def _previous_release(cfg: MoepipeConfig) -> str:
    """The newest kept release other than the one the deploy folder holds now."""
    from moepipe.utils.fs import read_json

    manifest = cfg.deploy_dir / MANIFEST
    current = read_json(manifest, "the deployment's manifest")["version"] \
        if manifest.is_file() else None
    kept = sorted((p for p in (cfg.deploy_dir / RELEASES).glob("*/k8s")
                   if p.parent.name != current), key=lambda p: p.parent.stat().st_mtime)
    if not kept:
        raise MoepipeError(f"no earlier release is kept in {cfg.deploy_dir / RELEASES}",
                           "deploy the earlier build's config with --rollout instead")
    return kept[-1].parent.name


def repository_dir(cfg: MoepipeConfig) -> Path:
    """Where the deploy renders the model repository (the deployment's identity on /proc)."""
    return cfg.deploy_dir / "model_repo"


def run_deploy(cfg: MoepipeConfig, echo: Callable[[str], None] = print,
               rollback: bool = False, to_cluster: bool = False) -> dict:
    """Render and (cpu) start the deployment of the config's build. A running local
    deployment of the same model is updated in place (:mod:`moepipe.commands.update`);
    ``rollback`` returns to the version the last update or deploy replaced. ``to_cluster``:
    roll it out blue/green to Kubernetes instead (:func:`run_rollout`)."""
    from moepipe.commands.update import previous_release, update_running

    if to_cluster:
        return run_rollout(cfg, echo, rollback)
    where = state_dir(cfg)
    current = lifecycle.status(where)
    target = get_target(cfg.target)
    if rollback and not target.live_update:
        raise MoepipeError(f"--rollback returns a local {cfg.target} deployment to its "
                           "previous version; this target is not served here",
                           "deploy the previous build's config instead")
    art = previous_release(where).artifacts() if rollback else None
    if current.get("server_alive") and target.live_update:
        art = art or artifacts(cfg)
        result = update_running(cfg, art, current, echo)
        if "restart" not in result:
            return result
        echo(f"deploy: {result['restart']}: restarting the server (requests in flight end)")
        lifecycle.stop(where)
        current = lifecycle.status(where)
    if current.get("server_alive"):
        raise MoepipeError(f"a server is already running for this workdir (pid "
                           f"{current['pid']}, http {current['http']})",
                           "run `moepipe stop` first")
    lifecycle.refuse_served(repository_dir(cfg))  # before rendering over its files
    left = lifecycle.clear(where)
    if left:
        echo(f"deploy: stopped {len(left)} process(es) an earlier deployment left behind")
    if not get_target(cfg.target).gpu:  # served here: only the processes and threads it can run
        from moepipe.utils.memory import available_cpus

        cfg.deploy.check_machine(available_cpus())
    art = art or artifacts(cfg)
    fallback = None
    if cfg.deploy.fallback is not None:
        fb_cfg = load_config(cfg.deploy.fallback.config)
        fallback = (fb_cfg, artifacts(fb_cfg))
    repo = render_deployment(cfg, art, fallback=fallback)
    echo(f"deploy: rendered {cfg.target} repository at {repo}")
    if get_target(cfg.target).gpu:  # nothing here can run it
        echo(_gpu_instructions(cfg, art, repo))
        return {"repository": str(repo), "started": False}
    d = cfg.deploy
    from moepipe.deploy.local.supervisor import spawn

    # A signal or an error before the supervisor has the server stops what was started.
    with lifecycle.guard(where):
        state = lifecycle.start(repo, where, host=d.host, http_port=d.http_port,
                                grpc_port=d.grpc_port, metrics_port=d.metrics_port,
                                timeout=d.ready_timeout_s, exit_timeout=d.exit_timeout_s,
                                binary=d.tritonserver)
        state = spawn(where, state, d.max_restarts)
    _record(cfg, art)
    echo(f"deploy: tritonserver ready (pid {state.pid}), version {art.version}\n"
         f"  http     http://{state.http}  (POST /v2/models/ensemble/generate)\n"
         f"  grpc     {state.grpc}\n"
         f"  metrics  http://{state.metrics}/metrics\n"
         f"  log      {state.log}\n"
         f"  restarts up to {d.max_restarts} time(s) if the server or a model process dies "
         "(deploy.max_restarts)\n"
         "  stop with `moepipe stop`")
    return {**state.to_status(True), "version": art.version}


def _record(cfg: MoepipeConfig, art: Artifacts) -> None:
    """Remember the version a fresh deploy serves, and the one it replaced (if another)."""
    from moepipe.commands.update import Release
    from moepipe.deploy.local.live import read_versions, record_versions

    now = Release.of(art).to_dict()
    before = read_versions(state_dir(cfg))
    last = before.get("serving") or {}
    previous = last if last.get("version") not in (None, art.version) else before.get("previous")
    record_versions(state_dir(cfg), now, previous)
