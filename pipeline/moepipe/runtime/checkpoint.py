"""Loading a TensorRT-LLM checkpoint folder (config.json + rank{r}.safetensors) for the
reference runtime, interpreting ``config.json`` as TensorRT-LLM 1.2 does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moepipe.arch import get_family_for_trtllm
from moepipe.arch.family import Family, RuntimeFacts
from moepipe.checkpoints.reader import load_file
from moepipe.errors import CheckpointError, UnsupportedError
from moepipe.mapping import Mapping
from moepipe.runtime.routing import RoutingSpec
from moepipe.utils.fs import read_json


@dataclass
class TrtllmCheckpoint:
    path: Path
    config: dict[str, Any]
    family: Family
    facts: RuntimeFacts
    mapping: Mapping
    routing: RoutingSpec
    ranks: dict[int, dict[str, torch.Tensor]]  # rank -> its tensors (the ranks loaded)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])


_REQUIRED = ("architecture", "dtype", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "vocab_size", "moe", "mapping")


def load_checkpoint(path: str | Path, ranks: list[int] | None = None) -> TrtllmCheckpoint:
    """A checkpoint folder with the tensors of ``ranks`` (default: every rank). A rank
    process of a multi-process deployment loads only its own ``rank{r}.safetensors``."""
    path = Path(path)
    cfg = read_config(path)
    mapping = Mapping.from_trtllm(cfg["mapping"])
    wanted = list(range(mapping.world_size)) if ranks is None else ranks
    bad = [r for r in wanted if not 0 <= r < mapping.world_size]
    if bad:
        raise CheckpointError(f"{path}: no rank {bad[0]} in a checkpoint of world size "
                              f"{mapping.world_size}",
                              "the rank must be below tp x pp of the checkpoint's mapping")
    tensors = {}
    for rank in wanted:
        file = path / f"rank{rank}.safetensors"
        if not file.is_file():
            raise CheckpointError(f"{path}: rank{rank}.safetensors is missing "
                                  f"(world size {mapping.world_size})",
                                  "the checkpoint is incomplete; convert it again")
        tensors[rank] = load_file(file)
    return with_tensors(path, cfg, tensors)


def with_tensors(path: Path, cfg: dict[str, Any],
                 ranks: dict[int, dict[str, torch.Tensor]]) -> TrtllmCheckpoint:
    """The checkpoint ``path`` with its config (:func:`read_config`) and these rank tensors."""
    family = get_family_for_trtllm(cfg["architecture"])
    return TrtllmCheckpoint(path=path, config=cfg, family=family,
                            facts=family.runtime_facts(cfg),
                            mapping=Mapping.from_trtllm(cfg["mapping"]),
                            routing=RoutingSpec.from_checkpoint_config(cfg), ranks=ranks)


def read_config(path: Path) -> dict[str, Any]:
    """A checkpoint folder's ``config.json``, checked for what the reference runtime runs."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory",
                              "pass a TensorRT-LLM checkpoint folder made by `moepipe convert`")
    cfg = read_json(path / "config.json", "a TensorRT-LLM checkpoint folder")
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise CheckpointError(f"{path / 'config.json'}: missing {', '.join(missing)}",
                              "not a TensorRT-LLM checkpoint config")
    get_family_for_trtllm(cfg["architecture"])
    if cfg.get("position_embedding_type", "rope_gpt_neox") != "rope_gpt_neox":
        raise UnsupportedError(f"position_embedding_type {cfg['position_embedding_type']}")
    scaling = cfg.get("rotary_scaling")
    if scaling and scaling.get("type") != "yarn":
        raise UnsupportedError("rotary_scaling is not implemented by the reference runtime "
                               "(only yarn)")
    for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                "output_multiplier_scale"):
        if float(cfg.get(key, 1.0)) != 1.0:
            raise UnsupportedError(f"{key} != 1 is not implemented by the reference runtime")
    if cfg.get("use_parallel_embedding"):
        raise UnsupportedError("use_parallel_embedding is not implemented by the reference runtime")
    return cfg
