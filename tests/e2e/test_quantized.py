"""End to end on the tiny examples: quantize (fp8 / int8_sq / int4_awq) -> convert at tp=2,
moe_ep=2 -> quality -> deploy on the cpu target -> validate. The quantized TensorRT-LLM
checkpoint at (tp=2, moe_ep=2) holds exactly the values of the tp=1 one (resharding is exact)."""

import json
import subprocess
import sys

import pytest
import yaml
from helpers import free_ports

pytest.importorskip("modelopt")

CASES = [  # (format, kv cache, example)
    ("fp8", "fp8", "tiny-mixtral"),
    ("int8_sq", "int8", "tiny-qwen2-moe"),
    ("int4_awq", "none", "tiny-mixtral-256"),
]


def _cli(*args, cwd):
    # modelopt patches transformers classes: quantize in a child process, as users do.
    return subprocess.run([sys.executable, "-m", "moepipe", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)


def _project(folder, fmt, kv, example, target="cpu"):
    http, grpc, metrics, ranks = free_ports(4)
    data = {"model": {"example": example}, "target": target,
            "parallel": {"tp": 2, "moe_ep": 2},
            "quantize": {"format": fmt, "kv_cache": kv,
                         "calibration": {"samples": 16, "seq_len": 64, "eval_samples": 4}},
            "build": {"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 256},
            "deploy": {"http_port": http, "grpc_port": grpc, "metrics_port": metrics,
                       "rank_port": ranks, "ready_timeout_s": 240},
            "validate": {"max_tokens": 12, "min_token_agreement": 0.0},
            "workdir": "work"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "moepipe.yaml").write_text(yaml.safe_dump(data))
    return folder


def _elements(t):
    """A tensor's elements as integers of the same width (exact, dtype-agnostic)."""
    import torch

    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(view).flatten()


def _assert_same_values(single, sharded):
    """Every tensor of the tp=1 checkpoint is, over the ranks of the sharded one, either
    replicated exactly or split without changing one element."""
    import torch
    from safetensors.torch import load_file

    one = load_file(single / "rank0.safetensors")
    ranks = [load_file(p) for p in sorted(sharded.glob("rank*.safetensors"))]
    assert len(ranks) == 2
    for name, full in one.items():
        parts = [r[name] for r in ranks if name in r]
        assert parts, f"{name} is on no rank"
        assert all(p.dtype == full.dtype for p in parts), name
        if all(p.shape == full.shape for p in parts):
            for p in parts:
                assert torch.equal(_elements(p), _elements(full)), f"{name} differs"
        else:
            got = torch.cat([_elements(p) for p in parts]).sort().values
            assert torch.equal(got, _elements(full).sort().values), f"{name}: values changed"
    assert set().union(*ranks) == set(one)


@pytest.mark.parametrize("fmt,kv,example", CASES, ids=[c[0] for c in CASES])
def test_quantized_build_deploy_validate(tmp_path, fmt, kv, example):
    folder = _project(tmp_path, fmt, kv, example)
    built = _cli("build", cwd=folder)
    assert built.returncode == 0, built.stderr
    work = folder / "work"
    manifest = json.loads((work / "build-manifest.json").read_text())
    stages = {s["stage"]: s for s in manifest["stages"]}
    assert list(stages) == ["source", "inspect", "quantize", "convert", "quality"]
    quality = stages["quality"]["details"]
    assert 0.9 < quality["logit_cosine"] <= 1.0 and 0 < quality["top1_agreement"] <= 1.0
    assert quality["ppl_quantized"] > 0 and "ppl_delta" in quality
    ckpt = json.loads((work / "checkpoint" / "config.json").read_text())
    algo = {"fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ"}[fmt]
    assert ckpt["quantization"]["quant_algo"] == algo
    assert ckpt["quantization"]["kv_cache_quant_algo"] == {"fp8": "FP8", "int8": "INT8",
                                                           "none": None}[kv]
    # Resharding is exact: the same quantized values as a tp=1 conversion.
    single = tmp_path / "tp1"
    conv = _cli("convert", "--model", work / "quantized", "--output", single, cwd=folder)
    assert conv.returncode == 0, conv.stderr
    _assert_same_values(single, work / "checkpoint")
    # Deploy what was measured; validate it.
    deployed = _cli("deploy", cwd=folder)
    assert deployed.returncode == 0, deployed.stderr
    try:
        proc = _cli("validate", cwd=folder)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads((work / "reports" / "validate.json").read_text())
        cases = {f"{j['job']}.{c['name']}": c["status"] for j in report["jobs"]
                 for c in j["cases"]}
        assert cases["accuracy.deployed_checkpoint"] == "passed"
        assert cases["smoke.grpc_streaming"] == "passed"
        if fmt == "int4_awq":  # a failing job is a non-zero exit
            text = (folder / "moepipe.yaml").read_text()
            (folder / "moepipe.yaml").write_text(
                text.replace("min_token_agreement: 0.0", "min_token_agreement: 1.0"))
            strict = _cli("validate", "--job", "accuracy", cwd=folder)
            assert strict.returncode == 1 and "FAIL accuracy.greedy_tokens" in strict.stdout
    finally:
        stopped = _cli("stop", cwd=folder)
    assert stopped.returncode == 0, stopped.stderr


def test_quantized_build_for_trtllm_pytorch_serves_the_unified_checkpoint(tmp_path):
    folder = _project(tmp_path, "fp8", "fp8", "tiny-qwen3-moe", target="trtllm-pytorch")
    built = _cli("build", cwd=folder)
    assert built.returncode == 0, built.stderr
    work = folder / "work"
    manifest = json.loads((work / "build-manifest.json").read_text())
    stages = [s["stage"] for s in manifest["stages"]]
    assert stages == ["source", "inspect", "quantize", "quality"]  # no TRT-LLM checkpoint
    assert manifest["stages"][-1]["details"]["logit_cosine"] > 0.9
    quant = json.loads((work / "quantized" / "hf_quant_config.json").read_text())
    assert quant["quantization"]["quant_algo"] == "FP8"
    deployed = _cli("deploy", cwd=folder)
    assert deployed.returncode == 0, deployed.stderr
    model_yaml = next((work / "deploy").rglob("model.yaml"))
    served = yaml.safe_load(model_yaml.read_text())["model"]
    # relative to the model's folder, args["model_repository"] (a relocatable deployment)
    assert (model_yaml.parent.parent / served).resolve() == (work / "quantized").resolve()
