"""Stage ``convert``: Hugging Face checkpoint -> TensorRT-LLM checkpoint (tp/pp/moe_tp/moe_ep),
planned by :mod:`moepipe.conversion.plan` and written by :mod:`moepipe.conversion.write`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moepipe.arch.hf import open_hf_checkpoint
from moepipe.checkpoints.dtypes import itemsize
from moepipe.config import MoepipeConfig
from moepipe.conversion.write import convert_into, convert_memory
from moepipe.stages.base import BuildContext, Stage, gib


def _settings(cfg: MoepipeConfig) -> dict[str, Any]:
    m = cfg.parallel.to_mapping()
    return {"tp": m.tp, "pp": m.pp, "moe_tp": m.moe_tp, "moe_ep": m.moe_ep,
            "dtype": cfg.model.dtype}


def _run(ctx: BuildContext, out: Path) -> dict[str, Any]:
    res = convert_into(open_hf_checkpoint(ctx.model_dir), out, ctx.cfg.parallel.to_mapping(),
                       dtype=ctx.cfg.model.dtype, workers=ctx.cfg.convert.workers,
                       progress=ctx.step)
    world = res.plan.mapping.world_size
    return {"world_size": world, "dtype": res.plan.dtype, "bytes": res.bytes_written,
            "rank_bytes": [res.plan.rank_bytes(r) for r in range(world)]}


def _preflight(ctx: BuildContext) -> None:
    """Families the target cannot take are refused before anything runs."""
    from moepipe.arch import get_family
    from moepipe.arch.family import check_quantizable
    from moepipe.stages.source import source_spec
    from moepipe.targets import check_family

    spec = source_spec(ctx)
    if spec is None:
        return
    family = get_family(spec.architecture)
    check_family(family, ctx.cfg.target, spec)
    check_quantizable(family, ctx.cfg.quantize.format)


def _memory(ctx: BuildContext) -> int:
    source = ctx.latest_hf_checkpoint  # None: planned before the model exists
    return convert_memory(source, ctx.cfg.parallel.to_mapping())


def _disk(ctx: BuildContext) -> int:
    """Bytes the output takes: the source's weights, scaled when the dtype changes."""
    source = ctx.model_dir
    total = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    ratio = 1.0
    if (source / "config.json").is_file():
        ckpt = open_hf_checkpoint(source)  # once: its spec and format say it all
        want = ctx.cfg.model.dtype
        if want != "auto" and ctx.cfg.quantize.format == "none":
            ratio = itemsize(want) / itemsize(ckpt.spec.torch_dtype)
        out = ckpt.spec.torch_dtype if want == "auto" else want
        if ckpt.fp8_block:
            # 1-byte weights come out in the model dtype (an upper bound: bf16 parts count twice)
            ratio = itemsize(out)
        if ckpt.mxfp4:
            # 4.25-bit MXFP4 experts come out in the model dtype (an upper bound, as above)
            ratio = 4 * itemsize(out)
    return int(total * ratio * 1.05) + (1 << 20)  # padded vocab, duplicated KV heads


STAGE = Stage("convert", 1, applies=lambda cfg: True,
              settings=_settings, inputs=("source", "quantize"), tools=(), run=_run,
              estimate=lambda ctx: {"host memory (peak)": gib(_memory(ctx))}, memory=_memory,
              preflight=_preflight,
              memory_hint="free memory, or use a smaller tp / moe_tp (column slices read whole "
                          "tensors)", link="checkpoint", disk=_disk)
