"""Opening a Hugging Face checkpoint folder: config, family, normalised spec, tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moepipe.arch import get_family
from moepipe.arch.family import Family
from moepipe.arch.spec import ModelSpec
from moepipe.checkpoints.fp8_block import Fp8BlockReader, block_size
from moepipe.checkpoints.modelopt import QuantInfo
from moepipe.checkpoints.mxfp4 import MXFP4_ARCHITECTURES, Mxfp4Reader
from moepipe.checkpoints.reader import CheckpointReader
from moepipe.errors import CheckpointError, UnsupportedError
from moepipe.utils.fs import read_json


@dataclass
class HFCheckpoint:
    path: Path
    config: dict[str, Any]
    family: Family
    spec: ModelSpec
    quant: QuantInfo | None = None  # a modelopt unified (quantized) checkpoint
    fp8_block: tuple[int, int] | None = None  # DeepSeek's block-scaled fp8 (read dequantized)
    mxfp4: bool = False  # GPT-OSS's MXFP4 experts (read dequantized)

    def reader(self) -> CheckpointReader:
        if self.fp8_block is not None:
            return Fp8BlockReader(self.path, self.fp8_block)
        if self.mxfp4:
            return Mxfp4Reader(self.path)
        return CheckpointReader(self.path)


def open_hf_checkpoint(path: str | Path) -> HFCheckpoint:
    """Read and normalise ``path/config.json``; tensors are validated when first read."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory",
                              "pass a Hugging Face checkpoint folder (config.json + *.safetensors)")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory",
                              "pass the folder that holds config.json, not a file")
    config = read_json(path / "config.json", "a Hugging Face checkpoint folder")
    archs = config.get("architectures")
    if not archs or not isinstance(archs, list):
        raise CheckpointError(f"{path / 'config.json'}: no 'architectures' entry",
                              "moepipe selects the converter by architectures[0]")
    family = get_family(archs[0])
    quant = None
    fp8 = None
    mxfp4 = False
    if "quantization_config" in config:
        if not isinstance(config["quantization_config"], dict):
            raise CheckpointError(f"{path / 'config.json'}: quantization_config is not a "
                                  "mapping")
        method = config["quantization_config"].get("quant_method")
        fp8 = block_size(config["quantization_config"], str(path / "config.json"))
        mxfp4 = method == "mxfp4"  # GPT-OSS as OpenAI publishes it: read dequantized
        if mxfp4 and archs[0] not in MXFP4_ARCHITECTURES:
            raise UnsupportedError(
                f"{path}: MXFP4 {archs[0]} checkpoints are not converted (moepipe reads MXFP4 "
                f"for {', '.join(MXFP4_ARCHITECTURES)})",
                "give moepipe the bf16 checkpoint")
        if fp8 is None and not mxfp4:
            if method != "modelopt" or not (path / "hf_quant_config.json").is_file():
                raise UnsupportedError(
                    f"{path}: is already quantized ({method}); moepipe converts unquantized "
                    "checkpoints, DeepSeek's block-scaled fp8 ones, GPT-OSS's MXFP4 ones and "
                    "its own (modelopt) quantized ones",
                    "give moepipe the unquantized checkpoint and choose a format in the "
                    "quantize section")
            quant = QuantInfo.parse(read_json(path / "hf_quant_config.json", "it"),
                                    str(path / "hf_quant_config.json"))
    spec = family.spec(config, str(path / "config.json"))
    return HFCheckpoint(path=path, config=config, family=family, spec=spec, quant=quant,
                        fp8_block=fp8, mxfp4=mxfp4)


# Files of a saved Hugging Face tokenizer (what AutoTokenizer reads, and what a deployment copies).
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "*.model",
                   "added_tokens.json", "chat_template*", "config.json",
                   "generation_config.json")


def tokenizer_files(path: Path) -> list[Path]:
    """The tokenizer files of a checkpoint folder; a CheckpointError when it has no tokenizer
    (no ``tokenizer*`` file): calibration and the deployments tokenize text."""
    files = sorted({p for pattern in TOKENIZER_FILES for p in path.glob(pattern) if p.is_file()})
    if not any(p.name.startswith("tokenizer") for p in files):
        raise CheckpointError(f"{path}: no tokenizer files (tokenizer.json / "
                              "tokenizer_config.json / tokenizer.model)",
                              "moepipe tokenizes text (calibration, serving): save the "
                              "tokenizer with the model (tokenizer.save_pretrained(folder))")
    return files
