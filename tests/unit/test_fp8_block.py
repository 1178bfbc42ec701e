"""DeepSeek's block-scaled FP8 checkpoints (``quant_method: fp8``, ``weight_block_size``, e4m3
weights beside float32 ``weight_scale_inv``; DeepSeek-V3 inference/fp8_cast_bf16.py) are read
dequantized: converting one gives exactly what converting the hand-dequantized weights gives,
and the reference runtime on it matches transformers on the dequantized model."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moepipe.conversion.write import convert
from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.model import Batch, ReferenceModel

BLOCK = 16  # DeepSeek publishes 128 x 128; tiny matrices need small blocks to have several


def _quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and per-block scales (amax / 448), edge blocks partial."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(br, block, bc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(br * block, bc * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def _by_hand(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = q.shape
    out = torch.empty(rows, cols)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[r, c] = q[r, c].float() * scale[i, j]
    return out


@pytest.fixture(scope="module")
def fp8_pair(examples, tmp_path_factory):
    """(fp8 folder, the same model with the weights dequantized by hand)."""
    root = tmp_path_factory.mktemp("fp8")
    src = examples["tiny-deepseek-v3"]
    fp8, plain = root / "fp8", root / "dequantized"
    shutil.copytree(src, fp8)
    shutil.copytree(src, plain)
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        linear = name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")
        if linear and w.dim() == 2:
            q, scale = _quantize(w, BLOCK)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            dequantized[name] = _by_hand(q, scale, BLOCK)
        else:
            quantized[name] = dequantized[name] = w
    # DeepSeek-V3's multi-token-prediction layer sits after the decoder layers on disk
    quantized["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(quantized, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return fp8, plain


@pytest.mark.parametrize("mapping", [(1, 1, 1, 1), (2, 1, 2, 1), (2, 2, 1, 2)])
def test_fp8_conversion_equals_hand_dequantized(fp8_pair, mapping, tmp_path):
    fp8, plain = fp8_pair
    tp, pp, moe_tp, moe_ep = mapping
    kw = dict(tp=tp, pp=pp, moe_tp=moe_tp, moe_ep=moe_ep, dtype="float32")
    convert(fp8, tmp_path / "a", **kw)
    convert(plain, tmp_path / "b", **kw)
    for rank in range(tp * pp):
        a = load_file(tmp_path / "a" / f"rank{rank}.safetensors")
        b = load_file(tmp_path / "b" / f"rank{rank}.safetensors")
        assert sorted(a) == sorted(b)
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_fp8_checkpoint_runs_like_transformers_on_the_dequantized_weights(fp8_pair, tmp_path):
    from transformers import AutoModelForCausalLM

    fp8, plain = fp8_pair
    convert(fp8, tmp_path / "ckpt", tp=2, moe_ep=2)
    ids = [54, 260, 402, 305, 77, 445, 510, 271, 494, 12]
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = ReferenceModel(load_checkpoint(tmp_path / "ckpt")).forward(Batch.single(ids),
                                                                     all_logits=True)
    assert (ours - ref).abs().max() <= 1e-4


def test_bad_fp8_scales_are_one_line_errors(fp8_pair, tmp_path):
    from moepipe.errors import CheckpointError, UnsupportedError

    fp8, _ = fp8_pair
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [32, 32]  # scales were made for 16
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="weight_scale_inv has shape"):
        convert(bad, tmp_path / "out")
    cfg["quantization_config"]["weight_block_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="weight_block_size"):
        convert(bad, tmp_path / "out2")


def test_host_memory_estimate_covers_dequantizing_the_largest_fp8_matrix(fp8_pair):
    from moepipe.conversion.write import BLOCK_BYTES, CONVERT_BASE, convert_memory
    from moepipe.mapping import Mapping

    fp8, plain = fp8_pair
    largest = max(w.numel() for n, w in load_file(fp8 / "model.safetensors").items()
                  if w.dtype == torch.float8_e4m3fn)
    assert convert_memory(fp8, Mapping.create()) == CONVERT_BASE + 16 * BLOCK_BYTES + 17 * largest
    assert convert_memory(plain, Mapping.create()) == CONVERT_BASE + 16 * BLOCK_BYTES
