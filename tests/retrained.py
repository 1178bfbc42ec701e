"""A re-trained expert subset, as a user ships one: a copy of a Hugging Face checkpoint folder
whose chosen experts' weights are changed (seeded), everything else byte for byte the same."""

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def retrain_experts(src: Path, dst: Path, layer: int = 0, experts: tuple[int, ...] = (1,),
                    seed: int = 1) -> Path:
    """``dst``: ``src`` with the Mixtral experts ``experts`` of ``layer`` perturbed."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{layer}.block_sparse_moe.experts."
    touched = 0
    for name, t in tensors.items():
        if any(name.startswith(f"{prefix}{e}.") for e in experts):
            tensors[name] = t + 0.5 * t.std() * torch.randn(t.shape, generator=g, dtype=t.dtype)
            touched += 1
    if not touched:
        raise ValueError(f"no tensor of experts {experts} in layer {layer} of {src}")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
