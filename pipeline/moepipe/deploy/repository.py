"""Rendering the deployment folder of a target: Triton model repository + tokenizer + extras.

``<deploy>/model_repo`` is an ensemble (preprocessing -> tensorrt_llm -> postprocessing) plus
``tensorrt_llm_bls``; only ``tensorrt_llm`` differs between targets. Values come from the one
config; the folder is written to a temporary sibling and renamed into place when complete.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moepipe import __version__
from moepipe.config import MoepipeConfig
from moepipe.deploy.gpu_targets import engine_values, pytorch_values
from moepipe.deploy.render import check_repository, render_tree, templates_root
from moepipe.errors import MoepipeError
from moepipe.utils.fs import atomic_dir

TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "*.model",
                   "added_tokens.json", "chat_template*", "config.json",
                   "generation_config.json")
MANIFEST = "moepipe-deploy.json"


@dataclass
class Artifacts:
    """What the build produced, as the deploy stage needs it."""

    model_dir: Path  # Hugging Face checkpoint (tokenizer, config)
    checkpoint_dir: Path | None = None  # TensorRT-LLM checkpoint (cpu target serves it)
    engine_dir: Path | None = None  # trtllm-engine
    hf_serving_dir: Path | None = None  # trtllm-pytorch (HF or unified quantized checkpoint)
    vocab_size: int = 0
    world_size: int = 1


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def common_values(cfg: MoepipeConfig, tokenizer_dir: Path, vocab_size: int) -> dict[str, str]:
    d = cfg.deploy
    return {
        "triton_max_batch_size": str(cfg.build.max_batch_size),
        "max_queue_delay_microseconds": str(d.max_queue_delay_microseconds),
        "max_queue_size": str(d.max_queue_size),
        "tokenizer_dir": str(tokenizer_dir),
        "add_special_tokens": _b(d.add_special_tokens),
        "skip_special_tokens": _b(d.skip_special_tokens),
        "vocab_size": str(vocab_size),
        "preprocessing_instance_count": str(d.instance_count),
        "postprocessing_instance_count": str(d.instance_count),
        "bls_instance_count": str(d.instance_count),
        "decoupled_mode": _b(d.decoupled),
        "accumulate_tokens": _b(d.accumulate_tokens),
    }


def cpu_values(cfg: MoepipeConfig, art: Artifacts, out: Path) -> dict[str, str]:
    if art.checkpoint_dir is None or not (art.checkpoint_dir / "config.json").is_file():
        raise MoepipeError("no converted checkpoint to serve", "run `moepipe build` first")
    return {
        "checkpoint_dir": str(art.checkpoint_dir.resolve()),
        "max_seq_len": str(cfg.build.max_seq_len),
        "max_input_len": str(cfg.build.max_input_len),
        "exclude_input_in_output": _b(cfg.deploy.exclude_input_in_output),
        "cpu_threads": str(cfg.deploy.cpu_threads),
    }


# target -> function giving the tensorrt_llm model's values (other targets register here).
TARGET_VALUES: dict[str, Callable[[MoepipeConfig, Artifacts, Path], dict[str, str]]] = {
    "cpu": cpu_values,
    "trtllm-engine": engine_values,
    "trtllm-pytorch": pytorch_values,
}


def copy_tokenizer(model_dir: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    found = False
    for pattern in TOKENIZER_FILES:
        for path in model_dir.glob(pattern):
            if path.is_file():
                shutil.copy2(path, dst / path.name)
                found = found or path.name.startswith("tokenizer")
    if not found:
        raise MoepipeError(f"{model_dir}: no tokenizer files (tokenizer.json / "
                           "tokenizer_config.json)",
                           "the deployment tokenizes text; save the tokenizer with the model")


def render_deployment(cfg: MoepipeConfig, art: Artifacts, overwrite: bool = True) -> Path:
    """Write ``cfg.deploy_dir`` for ``cfg.target``; returns the model repository path."""
    target = cfg.target
    if target not in TARGET_VALUES:
        raise MoepipeError(f"target '{target}' cannot be rendered yet")
    out = cfg.deploy_dir
    out.parent.mkdir(parents=True, exist_ok=True)
    root = templates_root()
    with atomic_dir(out, overwrite=overwrite) as tmp:
        # Paths inside the files point at the final location, not the temporary one.
        values = common_values(cfg, out / "tokenizer", art.vocab_size)
        values.update(TARGET_VALUES[target](cfg, art, out))
        copy_tokenizer(art.model_dir, tmp / "tokenizer")
        render_tree([root / "common", root / "targets" / target], values, tmp)
        repo = tmp / "model_repo"
        for model in repo.iterdir():
            (model / "1").mkdir(exist_ok=True)  # Triton needs a version folder, even empty
        configs = check_repository(repo)
        missing = {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing",
                   "tensorrt_llm_bls"} - configs.keys()
        if missing:
            raise MoepipeError(f"rendered repository lacks {', '.join(sorted(missing))}")
        (tmp / MANIFEST).write_text(json.dumps(
            {"target": target, "moepipe": __version__, "values": values,
             "models": sorted(configs)}, indent=2, sort_keys=True) + "\n")
    return out / "model_repo"
