"""Stage ``deploy``: render the target's deployment folder; for ``cpu`` start a local Triton."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from moepipe.config import MoepipeConfig
from moepipe.deploy import server
from moepipe.deploy.repository import Artifacts, render_deployment
from moepipe.errors import MoepipeError


def state_dir(cfg: MoepipeConfig) -> Path:
    return cfg.workdir / "triton"


def artifacts(cfg: MoepipeConfig) -> Artifacts:
    """What `moepipe build` left in the workdir for this config."""
    from moepipe.build import checkpoint_dir, model_dir

    model = model_dir(cfg, create=False)
    ckpt = checkpoint_dir(cfg)
    if not (ckpt / "config.json").is_file():
        raise MoepipeError(f"{ckpt}: no converted checkpoint", "run `moepipe build` first")
    trt = json.loads((ckpt / "config.json").read_text())
    return Artifacts(model_dir=model, checkpoint_dir=ckpt, vocab_size=int(trt["vocab_size"]),
                     world_size=int(trt["mapping"]["world_size"]))


def run_deploy(cfg: MoepipeConfig, echo: Callable[[str], None] = print) -> dict:
    current = server.status(state_dir(cfg))
    if current.get("running"):
        raise MoepipeError(f"a server is already running for this workdir (pid "
                           f"{current['pid']}, http {current['http']})",
                           "run `moepipe stop` first")
    repo = render_deployment(cfg, artifacts(cfg))
    echo(f"deploy: rendered {cfg.target} repository at {repo}")
    if cfg.target != "cpu":
        return {"repository": str(repo), "started": False}
    d = cfg.deploy
    state = server.start(repo, state_dir(cfg), host=d.host, http_port=d.http_port,
                         grpc_port=d.grpc_port, metrics_port=d.metrics_port,
                         timeout=d.ready_timeout_s, exit_timeout=d.exit_timeout_s,
                         binary=d.tritonserver)
    echo(f"deploy: tritonserver ready (pid {state.pid})\n"
         f"  http     http://{state.http}  (POST /v2/models/ensemble/generate)\n"
         f"  grpc     {state.grpc}\n"
         f"  metrics  http://{state.metrics}/metrics\n"
         f"  log      {state.log}\n"
         "  stop with `moepipe stop`")
    return state.to_status(True)
