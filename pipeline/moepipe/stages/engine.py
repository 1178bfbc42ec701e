"""Stage ``engine``: TensorRT engines from a TensorRT-LLM checkpoint with ``trtllm-build``.

TensorRT-LLM runs only inside NVIDIA's container on a GPU machine, so this stage is a thin
adapter: its command line, memory estimate and limit checks come from :mod:`moepipe.trtllm.engine`
(code that runs anywhere). Here: fail fast where ``trtllm-build`` or a GPU is missing, run the
command in a subprocess (so the GPU memory is freed when it ends) into the folder the runner
renames into place only when the engine is complete, and check the engine's config.json.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.errors import CheckpointError, EnvironmentMissing, MoepipeError
from moepipe.mapping import Mapping
from moepipe.stages.base import BuildContext, Stage, gib
from moepipe.stages.source import source_spec
from moepipe.trtllm.engine import (
    TRTLLM_BUILD,
    check_engine_limits,
    check_engine_version,
    checkpoint_mapping,
    engine_memory,
    engine_world_size,
    trtllm_build_command,
)
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER, TRTLLM_ENGINE_VERSION
from moepipe.utils.fs import read_json, tail_lines

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig

log = logging.getLogger("moepipe")
LOG_TAIL_LINES = 30


def _container_hint() -> str:
    return (f"build engines inside {TRITON_TRTLLM_CONTAINER} (TensorRT-LLM "
            f"{TRTLLM_ENGINE_VERSION}; docker/Dockerfile adds moepipe) on a machine with an "
            "NVIDIA GPU, e.g. `docker run --gpus all ...`")


def _cuda_visible(devices: str, gpus: int) -> int:
    """How many of ``gpus`` CUDA_VISIBLE_DEVICES leaves visible: CUDA stops at the first entry
    that is neither an index below ``gpus`` nor a GPU-/MIG- UUID (so ``-1`` hides them all)."""
    count = 0
    for entry in (e.strip() for e in devices.split(",")):
        if not (entry.isdigit() and int(entry) < gpus or entry.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return min(count, gpus)


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use: ``nvidia-smi -L``, narrowed by CUDA_VISIBLE_DEVICES.
    Raises EnvironmentMissing without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise EnvironmentMissing("no NVIDIA GPU visible: nvidia-smi not found", _container_hint())
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EnvironmentMissing(f"no NVIDIA GPU visible: nvidia-smi -L failed ({e})",
                                 _container_hint()) from None
    gpus = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    return gpus if devices is None else _cuda_visible(devices, gpus)


def require_build_environment() -> None:
    """Fail fast, naming the container, where ``trtllm-build`` or an NVIDIA GPU is missing."""
    if shutil.which(TRTLLM_BUILD) is None:
        raise EnvironmentMissing(f"{TRTLLM_BUILD} not found on PATH: TensorRT-LLM is not "
                                 "installed here", _container_hint())
    if visible_gpus() < 1:
        raise EnvironmentMissing("no NVIDIA GPU visible (nvidia-smi lists none, or "
                                 "CUDA_VISIBLE_DEVICES hides them all)", _container_hint())


def _check_engine(engine_dir: Path, expected: Mapping) -> tuple[dict[str, Any], str]:
    """The engine config of a finished build: an engine (not a checkpoint), for the
    checkpoint's mapping, with every rank file, built by the pinned TensorRT-LLM."""
    path = engine_dir / "config.json"
    config = read_json(path, "an engine folder")
    where = f"{TRTLLM_BUILD} output {path.name}"
    world = engine_world_size(config, where)
    built = Mapping.from_trtllm(config["pretrained_config"].get("mapping") or {})
    if built != expected:
        raise CheckpointError(f"{where}: the engine's mapping ({built.describe()}) differs from "
                              f"the checkpoint's ({expected.describe()})",
                              "rebuild the checkpoint and the engine")
    missing = [f"rank{r}.engine" for r in range(world)
               if not (engine_dir / f"rank{r}.engine").is_file()]
    if missing:
        raise CheckpointError(f"{TRTLLM_BUILD} finished but {', '.join(missing)} is missing")
    return config, check_engine_version(config, where)


def _run_logged(argv: list[str], log_path: Path) -> int:
    """Run ``argv`` with stdout and stderr going to ``log_path``; on Ctrl-C (or any error) its
    whole process group is stopped before the exception propagates."""
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait()
        except BaseException:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
            raise


def build_engine_into(cfg: MoepipeConfig, checkpoint_dir: Path, dest: Path, log_path: Path,
                      echo: Callable[[str], None]) -> dict[str, Any]:
    """Run ``trtllm-build`` into ``dest`` (an empty folder the caller renames into place when
    this returns) and check what it wrote."""
    command = trtllm_build_command(cfg, checkpoint_dir, dest)
    expected = checkpoint_mapping(checkpoint_dir)
    require_build_environment()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    echo(f"engine: {TRTLLM_BUILD} {expected.describe()} (log: {log_path})")
    start = time.monotonic()
    status = _run_logged(command, log_path)
    if status != 0:
        raise MoepipeError(f"{TRTLLM_BUILD} failed with exit status {status}",
                           f"the full output is in {log_path}",
                           details=tail_lines(log_path, LOG_TAIL_LINES))
    config, version = _check_engine(dest, expected)
    log.info("engine: built %s in %.0fs", dest, time.monotonic() - start)
    return {"trtllm_version": version, "command": command, "config": config}


# -- the stage ---------------------------------------------------------------------------------
def _settings(cfg: MoepipeConfig) -> dict[str, Any]:
    # The command line (for placeholder folders) is exactly what shapes the engine.
    return {"command": trtllm_build_command(cfg, Path("CHECKPOINT"), Path("ENGINE"))}


def _inputs(ctx: BuildContext):
    """(spec, mapping) of the engine's estimate, or None before the model exists."""
    spec = source_spec(ctx)
    return None if spec is None else (spec, ctx.cfg.parallel.to_mapping())


def _preflight(ctx: BuildContext) -> None:
    inputs = _inputs(ctx)
    if inputs is not None:
        check_engine_limits(ctx.cfg, *inputs)
    try:
        require_build_environment()
    except MoepipeError as e:
        raise type(e)(e.message, f"{e.hint}; `moepipe build --until convert` prepares the "
                                 "checkpoint on this machine") from None


def _command(ctx: BuildContext) -> list[str]:
    return trtllm_build_command(ctx.cfg, ctx.outputs.get("convert", ctx.cfg.workdir /
                                                         "checkpoint"),
                                ctx.outputs.get("engine", ctx.cfg.workdir / "engine"))


def _run(ctx: BuildContext, out: Path) -> dict[str, Any]:
    log_path = ctx.cfg.workdir / "logs" / "engine.trtllm-build.log"
    result = build_engine_into(ctx.cfg, ctx.output("convert"), out, log_path, ctx.echo)
    return {"trtllm_version": result["trtllm_version"], "log": str(log_path),
            "command": _command(ctx)}


def _routing_plan(ctx: BuildContext) -> str | None:
    """The routing plugin's edit of the engine (build.plugins.router: moepipe), for the plan."""
    spec = source_spec(ctx)
    if ctx.cfg.build.plugins.router != "moepipe" or spec is None:
        return None
    from moepipe.arch import get_family
    from moepipe.arch.routing import RoutingSpec
    from moepipe.plugins.trtllm_plan import describe, routing_plan

    routing = RoutingSpec.from_trtllm({
        "num_experts": spec.num_experts, "top_k": spec.top_k,
        "normalization_mode": get_family(spec.architecture).normalization_mode(spec)})
    return describe(routing_plan(routing, spec.num_layers))


def _estimate(ctx: BuildContext) -> dict[str, Any]:
    info: dict[str, Any] = {"command": _command(ctx)}
    plan = _routing_plan(ctx)
    if plan is not None:
        info["routing plugin"] = plan
    inputs = _inputs(ctx)
    if inputs is not None:
        usage = engine_memory(ctx.cfg, *inputs)
        info["GPU memory per GPU"] = ", ".join(
            f"{k.replace('_', ' ')} {gib(v)}" for k, v in usage.items())
    return info


STAGE = Stage("engine", 1, applies=lambda cfg: True,
              settings=_settings, inputs=("convert",), tools=("tensorrt-llm",), run=_run,
              estimate=_estimate, preflight=_preflight, link="engine", gpu=True)
