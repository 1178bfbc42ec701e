"""moepipe's unified export (:func:`moepipe.quant.recipe.export_unified`) on a freshly
calibrated model, so that what the oracle comparison (tests/unit/test_quant_oracle.py) relies on
cannot hide behind its golden files:

1. FP8: q/k/v share one weight scale, and so do each expert's gate and up; every FP8 weight is
   its bfloat16 weight divided by that scale in float32 and rounded once - so the converter
   never requantizes (it used to: 16-26% of qkv's bytes one fp8 step off).
2. INT4-AWQ: each expert's gate and up keep their own block scales (modelopt's unified export
   used to set both to their element-wise max).

modelopt patches transformers classes, so the calibration runs in a child process.
"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("modelopt")

PROBE = r"""
import copy, json, sys, warnings
from pathlib import Path

import torch
import modelopt.torch.quantization as mtq
from safetensors.torch import load_file
from transformers import MixtralConfig, MixtralForCausalLM

from moepipe.quant.recipe import export_unified, fuse_like_trtllm, quant_config
from moepipe.quant.unfuse import unfuse_experts

warnings.filterwarnings("ignore")
NAMES = ("w1", "w3", "w2")


def probe(fmt, out):
    dims = dict(hidden_size=32, intermediate_size=32) if fmt == "fp8" else \
        dict(hidden_size=128, intermediate_size=128, head_dim=64)
    torch.manual_seed(0)
    layers, experts = (2, 4) if fmt == "fp8" else (1, 2)  # AWQ's search is slow on CPU
    cfg = MixtralConfig(num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=experts, num_experts_per_tok=2, vocab_size=64,
                        architectures=["MixtralForCausalLM"], **dims)
    model = MixtralForCausalLM(cfg).eval()
    unfuse_experts(model, NAMES)
    calib = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, quant_config(fmt, "none"), lambda m: m(input_ids=calib))
    model = model.to(torch.bfloat16)
    fused = copy.deepcopy(model)
    fuse_like_trtllm(fused, NAMES)
    expected = {}
    for name, m in fused.named_modules():
        if getattr(getattr(m, "weight_quantizer", None), "is_enabled", False):
            if fmt == "fp8":
                scale = m.weight_quantizer.amax.float() / 448.0
                q = (m.weight.float() / scale).to(torch.float8_e4m3fn)
                expected[name] = {"weight": q.view(torch.uint8).tolist(), "scale": scale.item()}
            elif ".experts." in name and name.rsplit(".", 1)[-1] in NAMES[:2]:
                amax = m.weight_quantizer.amax.float().reshape(m.weight.shape[0], -1)
                expected[name] = {"scale": (amax / 7.0).tolist()}
    export_unified(model, out, NAMES)
    state = load_file(out / "model.safetensors")
    report = {}
    for name, want in expected.items():  # transformers 5 may write Mixtral's hub names back
        key = next(k for k in (name, name.replace(".mlp.", ".block_sparse_moe."))
                   if f"{k}.weight" in state)
        scale = state[f"{key}.weight_scale"].float()
        got = {"scale": scale.item() if fmt == "fp8" else scale.tolist()}
        if fmt == "fp8":
            got["weight"] = state[f"{key}.weight"].view(torch.uint8).tolist()
        report[name] = {"want": want, "got": got}
    json.dump(report, open(out / "probe.json", "w"))


for fmt in ("fp8", "int4_awq"):
    probe(fmt, Path(sys.argv[1]) / fmt)
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {fmt: json.loads((out / fmt / "probe.json").read_text())
            for fmt in ("fp8", "int4_awq")}


def test_fp8_weights_are_quantized_once_with_the_fused_scale(reports):
    import torch

    report = reports["fp8"]
    assert report
    for name, r in report.items():
        assert r["got"]["scale"] == pytest.approx(r["want"]["scale"], rel=1e-6), name
        got, want = torch.tensor(r["got"]["weight"]), torch.tensor(r["want"]["weight"])
        assert torch.equal(got, want), f"{name}: {(got != want).float().mean():.1%} bytes differ"
    for layer in range(2):  # q, k and v share one scale: TensorRT-LLM fuses them
        attn = f"model.layers.{layer}.self_attn"
        scales = {report[f"{attn}.{p}_proj"]["got"]["scale"] for p in "qkv"}
        assert len(scales) == 1, scales


def test_int4_awq_experts_keep_their_own_gate_and_up_block_scales(reports):
    import torch

    report = reports["int4_awq"]
    assert report
    own = 0
    for name, r in report.items():
        got, want = torch.tensor(r["got"]["scale"]), torch.tensor(r["want"]["scale"])
        assert torch.allclose(got, want, rtol=1e-6, atol=0), name
        if name.endswith(".w1"):
            up = torch.tensor(report[name[:-2] + "w3"]["got"]["scale"])
            own += not torch.equal(got, up)
    assert own, "every expert's gate and up scales are equal: they were synced"
