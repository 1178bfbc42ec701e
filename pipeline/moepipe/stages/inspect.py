"""Stage ``inspect``: what a checkpoint is, how big, and which parallel mappings are legal."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moepipe.arch import get_family
from moepipe.arch.hf import open_hf_checkpoint
from moepipe.arch.mla import DeepseekSpec
from moepipe.checkpoints.mxfp4 import BLOCKS, SCALES
from moepipe.checkpoints.reader import CheckpointReader
from moepipe.config import MoepipeConfig
from moepipe.errors import CheckpointError
from moepipe.mapping import check_mapping, legal_mappings
from moepipe.stages.base import BuildContext, Stage
from moepipe.targets import check_family


@dataclass
class Inspection:
    path: Path
    data: dict[str, Any]


def inspect_checkpoint(path: str | Path, max_world_size: int = 8) -> Inspection:
    ckpt = open_hf_checkpoint(path)
    spec, family = ckpt.spec, ckpt.family
    with CheckpointReader(ckpt.path) as reader:
        total = 0
        by_dtype: Counter[str] = Counter()
        for name, info in reader.tensors.items():
            numel = info.nbytes // info.dtype.itemsize
            if ckpt.mxfp4 and name.endswith((BLOCKS, SCALES)):  # two FP4 per byte; scales
                numel = 2 * numel if name.endswith(BLOCKS) else 0  # are not parameters
            total += numel
            by_dtype[str(info.dtype).removeprefix("torch.")] += info.nbytes
    per_expert = 3 * spec.expert_intermediate_size * spec.hidden_size
    dense = spec.first_k_dense_replace if isinstance(spec, DeepseekSpec) else 0
    moe_layers = spec.num_layers - dense
    inactive = moe_layers * (spec.num_experts - spec.top_k) * per_expert
    if inactive > total:  # the config's layers or experts are not the checkpoint's
        raise CheckpointError(f"{ckpt.path / 'config.json'}: {moe_layers} MoE layers of "
                              f"{spec.num_experts} experts are more parameters than the "
                              f"checkpoint's tensors hold ({total})",
                              "is config.json this checkpoint's own?")
    routing = family.normalization_mode(spec).description
    rs = spec.routing_spec if isinstance(spec, DeepseekSpec) else None  # may have no mode
    if rs is not None and rs.trtllm_normalization_mode() is None:
        routing = (f"{rs.score}{' + correction bias' if rs.correction_bias else ''}, best "
                   f"{rs.topk_group} of {rs.n_group} groups ({rs.group_score}), top-{rs.top_k}"
                   f"{', renormalised' if rs.renormalize else ''}, x{rs.routed_scaling_factor:g}"
                   " (moepipe_routing)")
    data = {
        "path": str(ckpt.path),
        "architecture": spec.architecture,
        "family": family.description,
        "layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "attention_heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "experts": spec.num_experts,
        "top_k": spec.top_k,
        "expert_intermediate_size": spec.expert_intermediate_size,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
        "routing": routing,
        "dtype": spec.torch_dtype,
        "parameters": {"total": total, "active_per_token": total - inactive},
        "bytes_by_dtype": dict(sorted(by_dtype.items())),
        "bytes_total": sum(by_dtype.values()),
        "largest_layer_bytes": _largest_layer_bytes(reader),
        "legal_mappings": [
            {"tp": m.tp, "pp": m.pp, "moe_tp": m.moe_tp, "moe_ep": m.moe_ep,
             "world_size": m.world_size}
            for m in legal_mappings(spec, max_world_size)],
    }
    if isinstance(spec, DeepseekSpec):  # multi-head latent attention
        data["attention"] = (f"MLA: q_lora_rank {spec.q_lora_rank or 'none'}, kv_lora_rank "
                             f"{spec.kv_lora_rank}, qk {spec.qk_nope_head_dim} + rope "
                             f"{spec.qk_rope_head_dim}, v {spec.v_head_dim}; {moe_layers} MoE "
                             f"layers after {spec.num_layers - moe_layers} dense")
    return Inspection(ckpt.path, data)


def _largest_layer_bytes(reader: CheckpointReader) -> int:
    sizes: Counter[str] = Counter()
    for name, info in reader.tensors.items():
        parts = name.split(".")
        key = ".".join(parts[:3]) if "layers" in parts else name
        sizes[key] += info.nbytes
    return max(sizes.values()) if sizes else 0


def format_inspection(data: dict[str, Any]) -> str:
    p = data["parameters"]
    lines = [
        f"{data['architecture']}  ({data['family']})",
        f"  path            {data['path']}",
        f"  layers          {data['layers']}  hidden {data['hidden_size']}  heads "
        f"{data['attention_heads']} (kv {data['kv_heads']}, head_dim {data['head_dim']})  vocab "
        f"{data['vocab_size']}",
        f"  experts         {data['experts']} routed, top-{data['top_k']}, expert FFN "
        f"{data['expert_intermediate_size']}"
        + (f", shared expert FFN {data['shared_expert_intermediate_size']}"
           if data["shared_expert_intermediate_size"] else ", no shared expert"),
        *([f"  attention       {data['attention']}"] if "attention" in data else []),
        f"  routing         {data['routing']}",
        f"  parameters      {_human(p['total'])} total, {_human(p['active_per_token'])} active "
        "per token",
        "  weights         " + ", ".join(f"{k} {_bytes(v)}" for k, v in
                                         data["bytes_by_dtype"].items())
        + f" (largest layer {_bytes(data['largest_layer_bytes'])})",
        "  legal mappings  (tp, pp, moe_tp, moe_ep)",
    ]
    by_world: dict[int, list[str]] = {}
    for m in data["legal_mappings"]:
        by_world.setdefault(m["world_size"], []).append(
            f"({m['tp']},{m['pp']},{m['moe_tp']},{m['moe_ep']})")
    for world, maps in sorted(by_world.items()):
        lines.append(f"    {world} GPU{'s' if world > 1 else ' '}  " + " ".join(maps))
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


# -- the stage ---------------------------------------------------------------------------------
def _settings(cfg: MoepipeConfig) -> dict[str, Any]:
    m = cfg.parallel.to_mapping()  # inspect checks that the model can be split this way
    return {"tp": m.tp, "pp": m.pp, "moe_tp": m.moe_tp, "moe_ep": m.moe_ep}


def _run(ctx: BuildContext, out: Path) -> dict[str, Any]:
    source = ctx.model_dir
    result = inspect_checkpoint(source)
    spec = open_hf_checkpoint(source).spec
    check_family(get_family(result.data["architecture"]), ctx.cfg.target, spec)
    check_mapping(spec, ctx.cfg.parallel.to_mapping())
    data = {k: v for k, v in result.data.items() if k != "path"}  # same input, same bytes
    (out / "inspect.json").write_text(json.dumps(data, indent=2) + "\n")
    ctx.echo(format_inspection(result.data))
    p = result.data["parameters"]
    return {"architecture": result.data["architecture"], "parameters": p["total"],
            "active_parameters": p["active_per_token"], "bytes": result.data["bytes_total"]}


def _preflight(ctx: BuildContext) -> None:
    """A family the target cannot serve is refused before anything runs."""
    from moepipe.stages.source import source_spec

    spec = source_spec(ctx)
    if spec is not None:
        check_family(get_family(spec.architecture), ctx.cfg.target, spec)


STAGE = Stage("inspect", 1, applies=lambda cfg: True, settings=_settings, inputs=("source",),
              tools=(), run=_run, preflight=_preflight)
