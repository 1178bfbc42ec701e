"""What every target's renderer shares: the build's artifacts and value helpers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moepipe.errors import ConfigError

# Characters the rendered files could not carry inside their double quotes (config.pbtxt,
# model.yaml, launch.sh).
_UNQUOTABLE = set('"\\`$\n\r')


@dataclass
class Artifacts:
    """What the build produced, as the deploy step needs it."""

    model_dir: Path  # Hugging Face checkpoint (tokenizer, config)
    checkpoint_dir: Path | None = None  # TensorRT-LLM checkpoint (cpu target serves it)
    engine_dir: Path | None = None  # trtllm-engine
    hf_serving_dir: Path | None = None  # trtllm-pytorch (HF or unified quantized checkpoint)
    vocab_size: int = 0
    # The build fingerprint of what is served (commands/build.py: served_version): the
    # deployment's version in its status, metrics and reports, and the live-update identity.
    version: str = ""


# TensorRT-LLM logits_dtype -> Triton data type of context_logits / generation_logits.
LOGITS_DATATYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


def flag(on: bool) -> str:
    """A boolean as the templates spell it."""
    return "true" if on else "false"


def quotable(value: str, what: str) -> str:
    """``value`` unchanged, or a ConfigError when a rendered file could not quote it."""
    bad = sorted(_UNQUOTABLE & set(value))
    if bad:
        raise ConfigError(f"{what} {value!r} contains {' '.join(map(repr, bad))}, which the "
                          "rendered deployment files cannot quote",
                          "use a path / address without quotes, backslashes, '$' or backticks")
    return value
