"""Layer-by-layer quantization writes what whole-model quantization writes.

For every quantizable family (from the registry) a seeded tiny bfloat16 checkpoint is quantized
both ways with the same calibration batches - the whole model calibrated at once, as moepipe's
quantize stage did before (``quant_reference.whole_model``), and one segment at a time
(:func:`moepipe.quant.layerwise.quantize_layerwise`) - for fp8 with and without an fp8 KV cache,
int8_sq with and without an int8 KV cache, and int4_awq. Every tensor is compared byte for byte
(scales, quantized weights, the 16-bit tensors), and ``config.json``, ``hf_quant_config.json``
and ``generation_config.json`` file for file: no bound is needed, because each layer sees
bit for bit the activations the whole model's calibration gives it and is calibrated and
exported by the same modelopt code in the same order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("modelopt")

from moepipe.arch import REGISTRY  # noqa: E402

HERE = Path(__file__).parent
FAMILIES = sorted(arch for arch, family in REGISTRY.items() if family.quantizable)
CASES = ["fp8+none", "fp8+fp8", "int8_sq+none", "int8_sq+int8", "int4_awq+none"]


def quantize_both(out: Path, arch: str, dtype: str, cases: list[str], *args: str) -> Path:
    proc = subprocess.run([sys.executable, str(HERE / "quant_reference.py"), arch, dtype,
                           str(out), ",".join(cases), *args], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return request.param, quantize_both(tmp_path_factory.mktemp(request.param), request.param,
                                        "bfloat16", CASES)


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    found: dict = {}
    for shard in sorted(folder.glob("*.safetensors")):
        part = load_file(shard)
        assert not set(part) & set(found), f"{shard.name} repeats tensors"
        found.update(part)
    return found


def assert_same_checkpoint(whole: Path, layerwise: Path) -> None:
    import torch

    want, got = tensors(whole), tensors(layerwise)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        raw = [t.reshape(-1).contiguous().view(torch.uint8) for t in (w, g)]
        assert torch.equal(*raw), f"{name}: {(raw[0] != raw[1]).float().mean():.2%} bytes differ"
    for name in ("config.json", "hf_quant_config.json", "generation_config.json"):
        assert (layerwise / name).read_bytes() == (whole / name).read_bytes(), name
    index = json.loads((layerwise / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    assert {p.name for p in layerwise.glob("*.safetensors")} == set(index["weight_map"].values())


@pytest.mark.parametrize("case", CASES)
def test_layerwise_checkpoint_equals_the_whole_model_one(family, case):
    arch, out = family
    assert_same_checkpoint(out / case / "whole", out / case / "layerwise-cpu")
    details = json.loads((out / case / "details-cpu.json").read_text())
    assert details["layers"] == 2 and details["shards"] == 4
    # every expert of every layer received routed tokens here, and the count is recorded
    assert details["unrouted_experts"] == [0, 0]


def test_float32_checkpoint_too(tmp_path):
    """The built-in examples are float32: nothing is cast before the export."""
    out = quantize_both(tmp_path, FAMILIES[0], "float32", ["fp8+fp8"])
    assert_same_checkpoint(out / "fp8+fp8" / "whole", out / "fp8+fp8" / "layerwise-cpu")


def test_tied_lm_head_is_written_once(tmp_path):
    out = quantize_both(tmp_path, FAMILIES[-1], "bfloat16", ["fp8+none"], "--variant", "tied")
    assert_same_checkpoint(out / "fp8+none" / "whole", out / "fp8+none" / "layerwise-cpu")
    assert "lm_head.weight" not in tensors(out / "fp8+none" / "layerwise-cpu")


def test_an_expert_the_router_never_chooses_is_calibrated_and_counted(tmp_path):
    """modelopt's moe_calib_experts_ratio=1.0 sends every calibration token through every
    expert, so an expert no token is routed to still gets calibrated scales; the stage record
    says, per layer, how many experts got no routed token."""
    import torch

    out = quantize_both(tmp_path, "MixtralForCausalLM", "bfloat16", ["fp8+none"],
                        "--variant", "dead-expert")
    layerwise = out / "fp8+none" / "layerwise-cpu"
    assert_same_checkpoint(out / "fp8+none" / "whole", layerwise)
    details = json.loads((out / "fp8+none" / "details-cpu.json").read_text())
    assert details["unrouted_experts"] == [1, 1]
    got = tensors(layerwise)
    for layer in range(2):
        for linear in ("w1", "w2", "w3"):
            prefix = f"model.layers.{layer}.block_sparse_moe.experts.4.{linear}"
            for scale in ("weight_scale", "input_scale"):
                value = got[f"{prefix}.{scale}"].float()
                assert torch.isfinite(value).all() and (value > 0).all(), f"{prefix}.{scale}"
