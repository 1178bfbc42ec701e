"""Template values of the ``cpu`` target: moepipe's reference runtime in a Triton Python model
(``targets/cpu/model_repo/tensorrt_llm/``), serving the converted TensorRT-LLM checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moepipe.deploy.local.state import control_socket
from moepipe.deploy.render.targets.base import Artifacts, flag, quotable
from moepipe.deploy.serve_paths import ServePaths
from moepipe.errors import MoepipeError

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig


def values(cfg: MoepipeConfig, art: Artifacts, paths: ServePaths) -> dict[str, str]:
    """Values of ``targets/cpu``: the checkpoint relative to the model's folder (the model
    resolves it against ``args["model_repository"]``), the limits and the engine's threads."""
    if art.checkpoint_dir is None or not (art.checkpoint_dir / "config.json").is_file():
        raise MoepipeError("no converted checkpoint to serve", "run `moepipe build` first")
    return {
        "checkpoint_dir": paths.from_model(art.checkpoint_dir, "the converted checkpoint"),
        "max_seq_len": str(cfg.build.max_seq_len),
        "max_input_len": str(cfg.build.max_input_len),
        "exclude_input_in_output": flag(cfg.deploy.exclude_input_in_output),
        "cpu_threads": str(cfg.deploy.cpu_threads),
        # the rank group (world size > 1): workers connect to the leader, rank 0 in this model
        "world_size": str(cfg.parallel.to_mapping().world_size),
        "rank_listen": rank_address(cfg.deploy.host, cfg.deploy.rank_port),
        "collective_timeout_s": f"{cfg.deploy.collective_timeout_s:g}",
        "rank_form_timeout_s": f"{cfg.deploy.ready_timeout_s:g}",
        "weights_version": quotable(art.version, "the build fingerprint"),
        # where `moepipe deploy` asks the running model to load new weights (owner only)
        "control_socket": paths.from_model(control_socket(cfg.workdir), "the control socket"),
    }


def rank_address(host: str, port: int) -> str:
    """host:port (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
