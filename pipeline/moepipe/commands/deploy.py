"""Stage ``deploy``: render the target's deployment folder; for ``cpu`` start a local Triton."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from moepipe.config import MoepipeConfig, load_config
from moepipe.deploy.local import lifecycle
from moepipe.deploy.render.repository import Artifacts, render_deployment
from moepipe.errors import MoepipeError


def state_dir(cfg: MoepipeConfig) -> Path:
    # Not "triton": a folder of that name in the working directory would shadow OpenAI Triton
    # for `python -m moepipe` run there.
    return cfg.workdir / "server"


def artifacts(cfg: MoepipeConfig) -> Artifacts:
    """What the last `moepipe build` of this workdir produced."""
    from moepipe.commands.build import model_dir, outputs
    from moepipe.utils.fs import read_json

    # GPU targets render without an engine (it is built on the GPU machine).
    built = outputs(cfg, optional=() if cfg.target == "cpu" else ("engine",))
    model = model_dir(cfg)
    ckpt = built.get("convert")
    serving = built.get("quantize") or model
    vocab = read_json((ckpt or serving) / "config.json", "the checkpoint")["vocab_size"]
    art = Artifacts(model_dir=model, checkpoint_dir=ckpt, engine_dir=built.get("engine"),
                    hf_serving_dir=serving, vocab_size=int(vocab))
    art.pod_memory_mib = pod_memory(cfg, model)
    return art


def pod_memory(cfg: MoepipeConfig, model: Path) -> int | None:
    """The planner's host memory of one serving pod, in MiB (the Kubernetes memory request
    and limit); None where the planner cannot read the model (the deploy then estimates from
    the built files)."""
    from moepipe.deploy.cluster.k8s import shape
    from moepipe.planner.plan import load_model
    from moepipe.planner.pods import pod_memory_mib
    from moepipe.planner.weights import Sharding

    try:
        shape_ = load_model(model)
    except MoepipeError:
        return None
    p, b = cfg.parallel, cfg.build
    m = p.to_mapping()
    sharding = Sharding(m.tp, m.pp, m.moe_tp, m.moe_ep, p.attention_dp)
    gpus = shape(cfg.target, m.world_size, cfg.deploy.k8s.gpus_per_node).gpus_per_pod
    return pod_memory_mib(shape_, sharding, cfg.target, fmt=cfg.quantize.format,
                          dtype=None if cfg.model.dtype == "auto" else cfg.model.dtype,
                          gpus_per_pod=gpus, max_batch_size=b.max_batch_size,
                          max_seq_len=b.max_seq_len)


def _gpu_instructions(cfg: MoepipeConfig, art: Artifacts, repo: Path) -> str:
    from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER

    out = repo.parent
    lines = [f"deploy: the {cfg.target} target runs on NVIDIA GPUs inside "
             f"{TRITON_TRTLLM_CONTAINER} (TensorRT-LLM is not installed here), so no server "
             "was started."]
    if cfg.target == "trtllm-engine":
        if art.engine_dir is None:
            lines.append(f"  the engine is not built yet: run `moepipe build` on the GPU "
                         f"machine (it writes {cfg.workdir / 'engine'})")
        lines.append(f"  then, in the container: bash {out / 'launch.sh'}  (one MPI rank per "
                     "GPU; it checks the engine's world size, the GPUs and the TensorRT-LLM "
                     "version before starting)")
    else:
        env = ""
        window = cfg.deploy.trtllm.expert_statistic
        if window is not None:  # TensorRT-LLM's workers read it from the server's environment
            import shlex

            from moepipe.trtllm.expert_statistic import environment

            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in environment(
                window.start, window.stop, str(cfg.expert_statistic_dir)).items()) + " "
        lines.append(f"  in the container: {env}tritonserver --model-repository {repo} "
                     f"--http-address {cfg.deploy.host} --http-port {cfg.deploy.http_port}")
    lines.append("  then: moepipe validate --url HOST:PORT --grpc-url HOST:PORT")
    return "\n".join(lines)


def repository_dir(cfg: MoepipeConfig) -> Path:
    """Where the deploy renders the model repository (the deployment's identity on /proc)."""
    return cfg.deploy_dir / "model_repo"


def run_deploy(cfg: MoepipeConfig, echo: Callable[[str], None] = print) -> dict:
    current = lifecycle.status(state_dir(cfg), repository_dir(cfg))
    if current.get("server_alive"):
        raise MoepipeError(f"a server is already running for this workdir (pid "
                           f"{current['pid']}, http {current['http']})",
                           "run `moepipe stop` first")
    left = lifecycle.clear(state_dir(cfg), repository_dir(cfg), current.get("pid"))
    if left:
        echo(f"deploy: stopped {len(left)} process(es) an earlier deployment left behind")
    if cfg.target == "cpu":  # served here: only as many processes and threads as it can run
        from moepipe.utils.memory import available_cpus

        cfg.deploy.check_machine(available_cpus())
    art = artifacts(cfg)
    fallback = None
    if cfg.deploy.fallback is not None:
        fb_cfg = load_config(cfg.deploy.fallback.config)
        fallback = (fb_cfg, artifacts(fb_cfg))
    repo = render_deployment(cfg, art, fallback=fallback)
    echo(f"deploy: rendered {cfg.target} repository at {repo}")
    if cfg.target != "cpu":
        echo(_gpu_instructions(cfg, art, repo))
        return {"repository": str(repo), "started": False}
    d = cfg.deploy
    state = lifecycle.start(repo, state_dir(cfg), host=d.host, http_port=d.http_port,
                            grpc_port=d.grpc_port, metrics_port=d.metrics_port,
                            timeout=d.ready_timeout_s, exit_timeout=d.exit_timeout_s,
                            binary=d.tritonserver)
    from moepipe.deploy.local.supervisor import spawn

    state = spawn(state_dir(cfg), state, d.max_restarts)
    echo(f"deploy: tritonserver ready (pid {state.pid})\n"
         f"  http     http://{state.http}  (POST /v2/models/ensemble/generate)\n"
         f"  grpc     {state.grpc}\n"
         f"  metrics  http://{state.metrics}/metrics\n"
         f"  log      {state.log}\n"
         f"  restarts up to {d.max_restarts} time(s) if the server or a model process dies "
         "(deploy.max_restarts)\n"
         "  stop with `moepipe stop`")
    return state.to_status(True)
