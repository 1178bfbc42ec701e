"""The build stages, in order, as data: what each depends on and how it runs.

Adding a stage = one entry here (plus its module). The runner (:mod:`moepipe.commands.build`) knows
nothing about what a stage does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moepipe.commands.build import BuildContext, Stage
from moepipe.config import MoepipeConfig
from moepipe.errors import ConfigError, MoepipeError
from moepipe.trtllm.mapping import Mapping


def mapping_of(cfg: MoepipeConfig) -> Mapping:
    p = cfg.parallel
    return Mapping.create(tp=p.tp, pp=p.pp, moe_tp=p.moe_tp, moe_ep=p.moe_ep)


# -- source: the user's checkpoint in place, or the built-in example written once ----------
def _source_settings(cfg: MoepipeConfig) -> dict[str, Any]:
    if cfg.model.example is not None:
        return {"example": cfg.model.example}
    return {"path": str(cfg.model.path)}


def _run_source(ctx: BuildContext, out: Path) -> dict[str, Any]:
    from moepipe.examples import write_example

    out.rmdir()  # write_example creates the folder itself (atomically)
    write_example(ctx.cfg.model.example, out)
    return {"example": ctx.cfg.model.example}


# -- inspect ----------------------------------------------------------------------------------
def _inspect_settings(cfg: MoepipeConfig) -> dict[str, Any]:
    m = mapping_of(cfg)  # inspect checks that the model can be split this way
    return {"tp": m.tp, "pp": m.pp, "moe_tp": m.moe_tp, "moe_ep": m.moe_ep}


def _run_inspect(ctx: BuildContext, out: Path) -> dict[str, Any]:
    from moepipe.checkpoints.hf import open_hf_checkpoint
    from moepipe.stages.inspect import format_inspection, inspect_checkpoint
    from moepipe.trtllm.mapping import check_mapping

    result = inspect_checkpoint(ctx.output("source"))
    check_mapping(open_hf_checkpoint(ctx.output("source")).spec, mapping_of(ctx.cfg))
    data = {k: v for k, v in result.data.items() if k != "path"}  # same input, same bytes
    (out / "inspect.json").write_text(json.dumps(data, indent=2) + "\n")
    ctx.echo(format_inspection(result.data))
    p = result.data["parameters"]
    return {"architecture": result.data["architecture"], "parameters": p["total"],
            "active_parameters": p["active_per_token"], "bytes": result.data["bytes_total"]}


# -- convert ----------------------------------------------------------------------------------
def _convert_settings(cfg: MoepipeConfig) -> dict[str, Any]:
    m = mapping_of(cfg)
    return {"tp": m.tp, "pp": m.pp, "moe_tp": m.moe_tp, "moe_ep": m.moe_ep,
            "dtype": cfg.model.dtype}


def _run_convert(ctx: BuildContext, out: Path) -> dict[str, Any]:
    from moepipe.checkpoints.hf import open_hf_checkpoint
    from moepipe.stages.convert import convert_into

    res = convert_into(open_hf_checkpoint(ctx.model_dir), out, mapping_of(ctx.cfg),
                       dtype=ctx.cfg.model.dtype, workers=ctx.cfg.convert.workers,
                       progress=ctx.step)
    return {"world_size": res.plan.mapping.world_size, "dtype": res.plan.dtype,
            "bytes": res.bytes_written}


def _convert_memory(ctx: BuildContext) -> int:
    from moepipe.preflight import convert_memory

    return convert_memory(ctx)


def _estimate_convert(ctx: BuildContext) -> dict[str, Any]:
    return {"host memory (peak)": _gib(_convert_memory(ctx))}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _needs_checkpoint(cfg: MoepipeConfig) -> bool:
    return cfg.target in ("cpu", "trtllm-engine")


def _source_spec(ctx: BuildContext):
    """The source model's spec (None at dry-run time when the example is not written yet)."""
    from moepipe.checkpoints.hf import open_hf_checkpoint

    src = ctx.outputs.get("source")
    if src is None or not (src / "config.json").is_file():
        if ctx.cfg.model.example is None:
            return None
        from moepipe.examples import example_spec

        return example_spec(ctx.cfg.model.example)
    return open_hf_checkpoint(src).spec


# -- quantize ---------------------------------------------------------------------------------
def _quantizes(cfg: MoepipeConfig) -> bool:
    return cfg.quantize.format != "none"


def _quantize_settings(cfg: MoepipeConfig) -> dict[str, Any]:
    q = cfg.quantize
    cal = q.calibration.model_dump(mode="json")
    if q.calibration.dataset is not None:  # the data, not where it lives, shapes the output
        from moepipe.checkpoints.hashcache import file_sha256

        cal["dataset"] = file_sha256(q.calibration.dataset) \
            if q.calibration.dataset.is_file() else str(q.calibration.dataset)
    return {"format": q.format, "kv_cache": q.kv_cache, "calibration": cal,
            "trust_remote_code": cfg.model.trust_remote_code}


def _preflight_quantize(ctx: BuildContext) -> None:
    from moepipe.stages.quantize import check_dimensions, check_environment

    check_environment(ctx.cfg.quantize.format)
    dataset = ctx.cfg.quantize.calibration.dataset
    if dataset is not None and not dataset.is_file():
        raise ConfigError(f"quantize.calibration.dataset: {dataset} does not exist",
                          "give a local .txt or .jsonl file (nothing is downloaded)")
    spec = _source_spec(ctx)
    if spec is not None:
        check_dimensions(ctx.cfg.quantize.format, spec)


def _run_quantize(ctx: BuildContext, out: Path) -> dict[str, Any]:
    from moepipe.stages.quantize import run_quantize

    return run_quantize(ctx.cfg, ctx.output("source"), out, echo=ctx.echo, step=ctx.step,
                        log_path=ctx.cfg.workdir / "logs" / "quantize.log")


def _quantize_memory(ctx: BuildContext) -> int:
    from moepipe.stages.engine import model_params
    from moepipe.stages.quantize import quantize_memory

    spec = _source_spec(ctx)
    return 0 if spec is None else quantize_memory(model_params(spec))


def _estimate_quantize(ctx: BuildContext) -> dict[str, Any]:
    q = ctx.cfg.quantize
    cal = q.calibration
    return {"format": f"{q.format} (kv cache {q.kv_cache}), {cal.samples} x {cal.seq_len} "
                      f"calibration tokens from {cal.dataset or 'the built-in corpus'}",
            "host memory (peak)": _gib(_quantize_memory(ctx))}


# -- quality ----------------------------------------------------------------------------------
def _run_quality(ctx: BuildContext, out: Path) -> dict[str, Any]:
    from moepipe.stages.quality import measure_quality

    result = measure_quality(ctx.output("source"), ctx.output("quantize"),
                             ctx.outputs.get("convert"), ctx.cfg.model.trust_remote_code,
                             step=ctx.step)
    (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
    ctx.echo(f"  quality: top-1 agreement {result['top1_agreement']:.4f}, logit cosine "
             f"{result['logit_cosine']:.4f}, perplexity {result['ppl']:.3f} -> "
             f"{result['ppl_quantized']:.3f} ({result['sequences']} held-out sequences)")
    return result


def _check_quality(cfg: MoepipeConfig, details: dict[str, Any]) -> None:
    from moepipe.stages.quality import check_quality

    if details:
        check_quality(cfg, details)


# -- engine -----------------------------------------------------------------------------------
def _builds_engine(cfg: MoepipeConfig) -> bool:
    return cfg.target == "trtllm-engine"


def _engine_settings(cfg: MoepipeConfig) -> dict[str, Any]:
    from moepipe.stages.engine import trtllm_build_command

    # The command line (for placeholder folders) is exactly what shapes the engine.
    return {"command": trtllm_build_command(cfg, Path("CHECKPOINT"), Path("ENGINE"))}


# Bytes per parameter of the engine's weights, for the memory estimate before quantizing.
_FORMAT_BYTES = {"fp8": 1.0, "int8_sq": 1.0, "int4_awq": 0.5, "w4a8_awq": 0.5, "nvfp4": 0.5625}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _engine_inputs(ctx: BuildContext):
    from moepipe.stages.engine import model_params

    spec = _source_spec(ctx)
    if spec is None:
        return None
    cfg = ctx.cfg
    dtype = spec.torch_dtype if cfg.model.dtype == "auto" else cfg.model.dtype
    per_param = _FORMAT_BYTES.get(cfg.quantize.format, _DTYPE_BYTES.get(dtype, 2))
    weight_bytes = int(model_params(spec) * per_param)
    kv_bytes = 1 if cfg.quantize.kv_cache != "none" else _DTYPE_BYTES.get(dtype, 2)
    return spec, mapping_of(cfg), weight_bytes, kv_bytes


def _preflight_engine(ctx: BuildContext) -> None:
    from moepipe.stages.engine import check_engine_limits, require_build_environment

    inputs = _engine_inputs(ctx)
    if inputs is not None:
        check_engine_limits(ctx.cfg, *inputs)
    try:
        require_build_environment()
    except MoepipeError as e:
        raise type(e)(e.message, f"{e.hint}; `moepipe build --until convert` prepares the "
                                 "checkpoint on this machine") from None


def _run_engine(ctx: BuildContext, out: Path) -> dict[str, Any]:
    from moepipe.stages.engine import build_engine_into

    log = ctx.cfg.workdir / "logs" / "engine.trtllm-build.log"
    result = build_engine_into(ctx.cfg, ctx.output("convert"), out, log, ctx.echo)
    return {"trtllm_version": result["trtllm_version"], "log": str(log),
            "command": trtllm_build_command_for(ctx)}


def trtllm_build_command_for(ctx: BuildContext) -> list[str]:
    from moepipe.stages.engine import trtllm_build_command

    return trtllm_build_command(ctx.cfg, ctx.outputs.get("convert", ctx.cfg.workdir /
                                                         "checkpoint"),
                                ctx.outputs.get("engine", ctx.cfg.workdir / "engine"))


def _estimate_engine(ctx: BuildContext) -> dict[str, Any]:
    from moepipe.stages.engine import engine_memory

    info: dict[str, Any] = {"command": trtllm_build_command_for(ctx)}
    inputs = _engine_inputs(ctx)
    if inputs is not None:
        usage = engine_memory(ctx.cfg, *inputs)
        info["GPU memory per GPU"] = ", ".join(
            f"{k.replace('_', ' ')} {_gib(v)}" for k, v in usage.items())
    return info


STAGES: list[Stage] = [
    Stage("source", 1, applies=lambda cfg: True, settings=_source_settings, inputs=(),
          tools=("transformers", "tokenizers"), run=_run_source),
    Stage("inspect", 1, applies=lambda cfg: True, settings=_inspect_settings,
          inputs=("source",), tools=(), run=_run_inspect),
    Stage("quantize", 1, applies=_quantizes, settings=_quantize_settings, inputs=("source",),
          tools=("nvidia-modelopt", "torch", "transformers"), run=_run_quantize,
          estimate=_estimate_quantize, memory=_quantize_memory,
          memory_hint="quantize on a machine with more memory (modelopt holds the model in "
                      "float32)", preflight=_preflight_quantize),
    Stage("convert", 1, applies=_needs_checkpoint, settings=_convert_settings,
          inputs=("source", "quantize"), tools=(), run=_run_convert,
          estimate=_estimate_convert, memory=_convert_memory,
          memory_hint="free memory, or use a smaller tp / moe_tp (column slices read whole "
                      "tensors)"),
    Stage("quality", 1, applies=_quantizes, settings=lambda cfg: {
        "dtype": cfg.model.dtype, "trust_remote_code": cfg.model.trust_remote_code},
          inputs=("source", "quantize", "convert"), tools=("torch", "transformers"),
          run=_run_quality, check=_check_quality),
    Stage("engine", 1, applies=_builds_engine, settings=_engine_settings,
          inputs=("convert",), tools=("tensorrt-llm",), run=_run_engine,
          estimate=_estimate_engine, preflight=_preflight_engine),
]
