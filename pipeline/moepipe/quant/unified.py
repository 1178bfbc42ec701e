"""The files of modelopt's unified Hugging Face checkpoint around its tensors, written as
``export_hf_checkpoint`` writes them for the whole model: ``hf_quant_config.json``,
``config.json`` with its ``quantization_config``, ``generation_config.json`` and the shard
index (``model.safetensors.index.json``, as ``save_pretrained`` writes it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moepipe.quant.skeleton import Skeleton

INDEX = "model.safetensors.index.json"


def shard_name(index: int, count: int) -> str:
    """transformers' name of shard ``index`` (0-based) of ``count``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def quant_config(skeleton: Skeleton, table: dict[str, Any], kv: str | None) -> dict[str, Any]:
    """``hf_quant_config.json`` from the per-module table of every segment, as modelopt's
    ``get_quant_config`` makes it from the whole model's, with the module names reverted to the
    checkpoint's (``export_hf_checkpoint``)."""
    import modelopt
    from modelopt.torch.export import unified_export_hf as ue
    from modelopt.torch.export.quant_aware_conversion import (
        build_reverse_name_mapper,
        revert_quant_config_names,
    )
    from modelopt.torch.export.quant_utils import process_layer_quant_config

    config: dict[str, Any] = {"producer": {"name": "modelopt", "version": modelopt.__version__},
                              "quantization": {"quant_algo": None, "kv_cache_quant_algo": None}}
    config["quantization"].update(process_layer_quant_config(table))
    if kv is not None:
        config["quantization"]["kv_cache_quant_algo"] = kv
    ue._add_mtp_exclusions(skeleton.model, config)
    mapper = build_reverse_name_mapper(skeleton.model)
    if mapper is not None:
        revert_quant_config_names(config["quantization"], mapper)
    return config


def write_configs(skeleton: Skeleton, source: Path, out: Path, hf_quant: dict[str, Any],
                  dtype: str) -> None:
    """``config.json`` (``dtype``: what the weights were cast to), ``generation_config.json``
    and ``hf_quant_config.json`` into ``out``, as ``export_hf_checkpoint`` writes them."""
    from modelopt.torch.export import unified_export_hf as ue
    from transformers import GenerationConfig

    model = skeleton.model
    config = model.config
    config.dtype = dtype  # save_pretrained records the dtype of the weights it saves
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    if (source / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    ue._sanitize_generation_config_for_save(model)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    ue._write_hf_export_config(model, hf_quant, out)


def write_index(out: Path, weight_map: dict[str, str], total_size: int) -> None:
    """The shard index, sorted by tensor name as ``save_pretrained`` sorts it."""
    index = {"metadata": {"total_size": total_size},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
