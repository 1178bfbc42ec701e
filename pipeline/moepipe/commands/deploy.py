"""Stage ``deploy``: render the target's deployment folder; for ``cpu`` start a local Triton."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path

from moepipe.config import MoepipeConfig, load_config
from moepipe.deploy.local import lifecycle
from moepipe.deploy.render.repository import Artifacts, render_deployment
from moepipe.deploy.serve_paths import ServePaths
from moepipe.deploy.tritonserver import ServerCommand
from moepipe.errors import MoepipeError
from moepipe.targets import get_target


def state_dir(cfg: MoepipeConfig) -> Path:
    # Not "triton": a folder of that name in the working directory would shadow OpenAI Triton
    # for `python -m moepipe` run there.
    return cfg.workdir / "server"


def artifacts(cfg: MoepipeConfig) -> Artifacts:
    """What the last `moepipe build` of this workdir produced."""
    from moepipe.commands.build import model_dir, outputs
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
                     hf_serving_dir=serving, vocab_size=int(vocab))


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
    return "\n".join(lines)


def repository_dir(cfg: MoepipeConfig) -> Path:
    """Where the deploy renders the model repository (the deployment's identity on /proc)."""
    return cfg.deploy_dir / "model_repo"


def run_deploy(cfg: MoepipeConfig, echo: Callable[[str], None] = print) -> dict:
    where = state_dir(cfg)
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
    art = artifacts(cfg)
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
    echo(f"deploy: tritonserver ready (pid {state.pid})\n"
         f"  http     http://{state.http}  (POST /v2/models/ensemble/generate)\n"
         f"  grpc     {state.grpc}\n"
         f"  metrics  http://{state.metrics}/metrics\n"
         f"  log      {state.log}\n"
         f"  restarts up to {d.max_restarts} time(s) if the server or a model process dies "
         "(deploy.max_restarts)\n"
         "  stop with `moepipe stop`")
    return state.to_status(True)
