"""modelopt's side of moepipe's quantization: the calibration recipe and the export steps that
make the unified Hugging Face checkpoint hold exactly what modelopt's own TensorRT-LLM exporter
would write (the oracle, ``tests/oracle``).

Only torch, modelopt and :mod:`moepipe.errors` are imported here, so the oracle script runs this
very code in its side virtualenv (transformers 4.57), without moepipe's dependencies.

Why the export needs help (modelopt 0.47, ``modelopt/torch/export``):

* **Fused groups share their scale before export.** TensorRT-LLM fuses q/k/v (and an FP8
  expert's up/gate) into one tensor with one per-tensor FP8 scale. modelopt's unified export
  keeps q, k and v's own FP8 scales (``_fuse_shared_input_modules`` skips FP8), so a converter
  would have to requantize fp8 values to the shared scale - a second rounding. The TensorRT-LLM
  exporter instead shares the amax first (``preprocess_linear_fusion``, ``layer_utils.build_qkv``,
  ``build_stacked_experts``) and quantizes the weights once. :func:`fuse_like_trtllm` runs those
  same modelopt steps before the unified export.
* **INT4-AWQ experts keep their own block scales.** The unified export's
  ``sync_moe_gate_up_amax`` replaces an expert's gate and up block amaxes with their
  element-wise max (needed for NVFP4's shared global scale, not for INT4 blocks, which belong to
  separate rows of TensorRT-LLM's ``[up | gate]`` tensor). :func:`exact_export` keeps INT4-AWQ
  per-block amaxes as calibrated; other amaxes are still synced.
* **FP8 weights are rounded once.** The unified export divides a 16-bit weight by a 0-d float32
  scale, which torch computes in the 16-bit dtype: the quotient is rounded to bfloat16 before
  the fp8 cast (about 1-3% of the bytes one fp8 step off). :func:`exact_export` divides in
  float32, as the TensorRT-LLM exporter's ``[1]``-shaped scale does.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.errors import EnvironmentMissing

if TYPE_CHECKING:
    from torch import nn

# moepipe format -> (modelopt config, TensorRT-LLM quant_algo)
FORMATS = {
    "fp8": ("FP8_DEFAULT_CFG", "FP8"),
    "int8_sq": ("INT8_SMOOTHQUANT_CFG", "W8A8_SQ_PER_CHANNEL"),
    "int4_awq": ("INT4_AWQ_CFG", "W4A16_AWQ"),
    "w4a8_awq": ("W4A8_AWQ_BETA_CFG", "W4A8_AWQ"),
    "nvfp4": ("NVFP4_DEFAULT_CFG", "NVFP4"),
}
KV_QUANTIZER = "*[kv]_bmm_quantizer"
KV_FORMATS = {"fp8": {"num_bits": (4, 3), "axis": None}, "int8": {"num_bits": 8, "axis": None}}
MODELOPT_VERSION = "0.47"  # the version whose export internals exact_export() adjusts


def quant_config(fmt: str, kv_cache: str, *, quantize_experts: bool | None = None
                 ) -> dict[str, Any]:
    """modelopt's config for ``fmt``: calibration reaches every expert; ``int8_sq`` keeps the
    routed experts in the model dtype unless ``quantize_experts`` (TensorRT-LLM 1.2 has no
    SmoothQuant MoE: its exporter excludes the MoE block)."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, FORMATS[fmt][0]))
    algorithm = cfg.get("algorithm") or "max"
    if isinstance(algorithm, str):
        algorithm = {"method": algorithm}
    algorithm["moe_calib_experts_ratio"] = 1.0  # every expert sees calibration tokens
    cfg["algorithm"] = algorithm
    if quantize_experts is None:
        quantize_experts = fmt != "int8_sq"
    if not quantize_experts:
        cfg["quant_cfg"].append({"quantizer_name": "*experts.*", "enable": False})
    if kv_cache != "none":
        cfg["quant_cfg"].append({"quantizer_name": KV_QUANTIZER, "cfg": KV_FORMATS[kv_cache]})
    return cfg


def _quantized(module: nn.Module) -> bool:
    wq = getattr(module, "weight_quantizer", None)
    return wq is not None and bool(getattr(wq, "is_enabled", False))


def fuse_like_trtllm(model: nn.Module, expert_names: tuple[str, str, str]) -> int:
    """Run, on the calibrated ``model``, the fusion steps of modelopt's TensorRT-LLM exporter:
    q/k/v share their amax (and smoothing); each MoE block's experts are resmoothed together
    (gate and up of all experts, down of all experts) and each expert's gate/up share scalar
    amaxes; a dense gate/up pair is fused for FP8. ``expert_names`` = (gate, up, down) module
    names inside an expert. Returns the number of groups fused."""
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import (
        get_quantization_format,
        preprocess_linear_fusion,
    )
    from torch import nn

    gate, up, down = expert_names
    fused = 0
    for module in model.modules():
        qkv = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if all(isinstance(m, nn.Module) and _quantized(m) for m in qkv):
            preprocess_linear_fusion(qkv)  # layer_utils.build_qkv
            fused += 1
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.ModuleList) and len(experts) and \
                all(isinstance(getattr(e, gate, None), nn.Module) for e in experts):
            if not _quantized(getattr(experts[0], gate)):
                continue
            # layer_utils.build_stacked_experts, in its order
            preprocess_linear_fusion([getattr(e, down) for e in experts], resmooth_only=True)
            preprocess_linear_fusion([getattr(e, n) for e in experts for n in (gate, up)],
                                     resmooth_only=True)
            for e in experts:
                preprocess_linear_fusion([getattr(e, gate), getattr(e, up)])
            fused += 1
            continue
        pair = [getattr(module, n, None) for n in ("gate_proj", "up_proj")]
        if all(isinstance(m, nn.Module) and _quantized(m) for m in pair) and \
                get_quantization_format(pair[0]) == QUANTIZATION_FP8:
            preprocess_linear_fusion(pair)  # layer_utils.build_mlp (FP8 merges gate and fc)
            fused += 1
    return fused


def export_unified(model: nn.Module, out: Path, expert_names: tuple[str, str, str],
                   **kwargs: Any) -> None:
    """modelopt's unified Hugging Face export of the calibrated ``model`` into ``out``, holding
    what modelopt's TensorRT-LLM exporter would write (``kwargs`` go to
    ``export_hf_checkpoint``). Changes ``model`` (as the export itself does)."""
    from modelopt.torch.export import export_hf_checkpoint

    fuse_like_trtllm(model, expert_names)
    with exact_export():
        export_hf_checkpoint(model, export_dir=out, **kwargs)


@contextlib.contextmanager
def exact_export() -> Iterator[None]:
    """Around ``export_hf_checkpoint``: keep INT4-AWQ per-block amaxes out of the gate/up sync
    (other formats, NVFP4 included, are synced as modelopt does) and quantize FP8 weights in
    float32 (see the module docstring)."""
    import modelopt
    import torch
    from modelopt.torch.export import unified_export_hf as ue
    from modelopt.torch.export.model_config import QUANTIZATION_FP8, QUANTIZATION_INT4_AWQ
    from modelopt.torch.export.quant_utils import get_quantization_format

    if not modelopt.__version__.startswith(MODELOPT_VERSION + "."):
        raise EnvironmentMissing(f"moepipe's quantized export needs nvidia-modelopt "
                                 f"{MODELOPT_VERSION}.x, found {modelopt.__version__}",
                                 "pip install 'moepipe[quantize]'")
    sync, quantize = ue.sync_moe_gate_up_amax, ue.to_quantized_weight

    def sync_scalar_amax_only(model: nn.Module) -> int:
        quantizers: list[Any] = [m.weight_quantizer for m in model.modules() if _quantized(m)
                                 and get_quantization_format(m) == QUANTIZATION_INT4_AWQ]
        blocks = [(q, q.amax.clone()) for q in quantizers
                  if getattr(q, "amax", None) is not None and q.amax.numel() > 1]
        count = sync(model)
        restored = sum(not torch.equal(q.amax, amax) for q, amax in blocks)
        for q, amax in blocks:
            q.amax = amax
        return 0 if restored else count  # the count only feeds modelopt's warning

    def quantize_in_float32(weight: torch.Tensor, scale: torch.Tensor, quantization: str,
                            *args: Any, **kwargs: Any) -> torch.Tensor:
        if quantization == QUANTIZATION_FP8 and weight.dtype != torch.float8_e4m3fn:
            weight, scale = weight.float(), scale.float()
        return quantize(weight, scale, quantization, *args, **kwargs)

    ue.sync_moe_gate_up_amax, ue.to_quantized_weight = sync_scalar_amax_only, \
        quantize_in_float32
    try:
        yield
    finally:
        ue.sync_moe_gate_up_amax, ue.to_quantized_weight = sync, quantize


# Modules that must stay unquantized (routers, shared-expert gate), by name fragment.
NEVER_QUANTIZED = (".gate.", "block_sparse_moe.gate", "shared_expert_gate", "router")


def inspect_quantizers(model: nn.Module) -> tuple[int, list[str]]:
    """How many modules got an enabled weight quantizer, and which routers did (none!)."""
    quantized, never = 0, []
    for name, module in model.named_modules():
        if _quantized(module):
            quantized += 1
            if any(frag in name + "." for frag in NEVER_QUANTIZED) and "experts" not in name:
                never.append(name)
    return quantized, never


def int8_kv_scales(model: nn.Module) -> dict[str, Any]:
    """modelopt's unified export takes FP8 KV scales only. For INT8 the scales (amax / 127)
    are written as ``k_proj.k_scale`` / ``v_proj.v_scale`` like FP8's, and the quantizers are
    switched off before export."""
    import torch

    extra = {}
    for name, module in model.named_modules():
        for kind in ("k", "v"):
            quantizer = getattr(module, f"{kind}_bmm_quantizer", None)
            if quantizer is None or quantizer.amax is None:
                continue
            scale = (quantizer.amax.float().max() / 127.0).reshape(())
            extra[f"{name}.{kind}_proj.{kind}_scale"] = scale.to(torch.float32).cpu()
            quantizer.reset_amax()  # else the export still finds (and rejects) its amax
            quantizer.disable()
    return extra


def mark_int8_kv(out: Path) -> None:
    """Declare the INT8 KV cache in the exported ``hf_quant_config.json`` and ``config.json``
    (modelopt's export knows FP8 KV caches only)."""
    import json

    path = out / "hf_quant_config.json"
    data = json.loads(path.read_text())
    data["quantization"]["kv_cache_quant_algo"] = "INT8"
    path.write_text(json.dumps(data, indent=4) + "\n")
    cfg_path = out / "config.json"
    config = json.loads(cfg_path.read_text())
    qc = config.get("quantization_config", {})
    qc["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "int"}
    config["quantization_config"] = qc
    cfg_path.write_text(json.dumps(config, indent=2) + "\n")
