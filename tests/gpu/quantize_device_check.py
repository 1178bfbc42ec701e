"""Layer-by-layer quantization on one device against another (a GPU against the CPU): the same
seeded tiny bfloat16 Mixtral as tests/e2e/test_layerwise_equivalence.py, quantized one layer
at a time on each device with the same calibration batches, compared tensor by tensor.

What must agree, and why:

* bfloat16 tensors (norms, embedding, lm_head, routers) and, for fp8, the quantized weights and
  weight scales are equal byte for byte: a weight scale is the weight's max |w| / 448 (exact on
  any device) and weights are quantized on the CPU, after calibration, on both.
* Activation scales (``input_scale``, the KV cache's ``k_scale`` / ``v_scale``) come from
  activations computed by each device's matmul kernels, whose summation order differs: within a
  relative 1e-3 (float32 activations agree to about 1e-6; an amax is one of them).
* int8_sq's smoothing factors come from those activations, so its int8 weights may differ by one
  step in a few places: at most 1 in 1000 bytes, never by more than 1.

Usage (writes JSON, exit 1 when anything disagrees):
``python tests/gpu/quantize_device_check.py OUT.json [--devices cuda,cpu] [--work DIR]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ["fp8+fp8", "int8_sq+none"]


def quantize(work: Path, device: str, tag: str) -> None:
    """Layer-by-layer quantization of the tiny Mixtral on ``device`` into ``layerwise-<tag>``
    (in a child process: modelopt patches transformers classes)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "quant_reference.py"),
                           "MixtralForCausalLM", "bfloat16", str(work), ",".join(CASES),
                           "--only", "layerwise", "--device", device, "--tag", tag],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"quantizing on {device} failed:\n{proc.stderr[-3000:]}")


ACTIVATION_SCALES = ("input_scale", "k_scale", "v_scale")
SMOOTHED = ("weight_scale", "pre_quant_scale")  # int8_sq: follow the activations


def compare(a: Path, b: Path, smoothed: bool) -> dict:
    """The disagreements between two unified checkpoints: tensors that differ where they must
    not, the largest relative difference of the scales that may, the int8 weights' share of
    differing bytes and largest step."""
    import torch
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        out: dict = {}
        for shard in sorted(folder.glob("*.safetensors")):
            out.update(load_file(shard))
        return out

    ta, tb = tensors(a), tensors(b)
    report = {"same_names": sorted(ta) == sorted(tb), "differ": [], "max_scale_rel": 0.0,
              "int8_fraction": 0.0, "int8_max_step": 0}
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if (x.dtype, x.shape) != (y.dtype, y.shape):
            report["differ"].append(name)
        elif name.endswith(ACTIVATION_SCALES) or smoothed and name.endswith(SMOOTHED):
            rel = ((x.float() - y.float()).abs() / y.float().abs().clamp_min(1e-30)).max()
            report["max_scale_rel"] = max(report["max_scale_rel"], float(rel))
        elif smoothed and x.dtype == torch.int8:
            step = (x.int() - y.int()).abs()
            report["int8_max_step"] = max(report["int8_max_step"], int(step.max()))
            report["int8_fraction"] = max(report["int8_fraction"],
                                          float((step > 0).float().mean()))
        elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            report["differ"].append(name)
    report["ok"] = (report["same_names"] and not report["differ"]
                    and report["max_scale_rel"] <= 1e-3 and report["int8_fraction"] <= 1e-3
                    and report["int8_max_step"] <= 1)
    return report


def check(work: Path, devices: tuple[str, str]) -> dict:
    """Quantize on both devices; the comparison of each case."""
    tags = devices if devices[0] != devices[1] else (f"{devices[0]}1", f"{devices[1]}2")
    for device, tag in zip(devices, tags, strict=True):
        quantize(work, device, tag)
    result: dict = {"devices": list(devices), "cases": {}}
    for case in CASES:
        report = compare(work / case / f"layerwise-{tags[0]}",
                         work / case / f"layerwise-{tags[1]}", case.startswith("int8_sq"))
        details = json.loads((work / case / f"details-{tags[0]}.json").read_text())
        report["device_recorded"] = details["device"]
        result["cases"][case] = report
    result["ok"] = all(r["ok"] for r in result["cases"].values())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", default="cuda,cpu")
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="moepipe-qdev-"))
    first, second = args.devices.split(",")
    result = check(work, (first, second))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
