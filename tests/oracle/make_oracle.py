"""Make the quantization oracle's golden files (run by ``tests/oracle/make-oracle.sh``).

modelopt 0.47 still ships its (deprecated, removed in 0.49) TensorRT-LLM exporter,
``export_tensorrt_llm_checkpoint``, which writes TensorRT-LLM checkpoints straight from the
calibrated model: the reference for what TensorRT-LLM expects. It needs transformers 4.x, so
this script runs in a side virtualenv (transformers 4.57, modelopt 0.47, torch 2.13 CPU).

For each case it builds a seeded tiny Mixtral, calibrates it once with moepipe's own recipe
(:mod:`moepipe.quant.recipe`, imported from this checkout), and exports the same calibrated
model both ways:

* ``<case>/unified/``: modelopt's unified Hugging Face checkpoint, exactly as moepipe's
  ``quantize`` stage exports it - the input the comparison test converts with moepipe;
* ``<case>/oracle-tp<N>.json``: what modelopt's TensorRT-LLM exporter writes at tp=N: its
  ``config.json`` and, per rank, every tensor's dtype, shape and sha256; float32 tensors (the
  scales, the router) and small 16-bit ones (norms, pre-quant scales) also their values (base64
  of the raw little-endian bytes).

The whole output is a few hundred KB; ``tests/unit/test_quant_oracle.py`` compares against it
without the side virtualenv. ``--full DIR`` also keeps the complete TensorRT-LLM checkpoints.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "pipeline"))  # moepipe.quant.recipe needs only torch + modelopt

from moepipe.quant.recipe import export_unified, quant_config  # noqa: E402

COMMON = dict(max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=False, architectures=["MixtralForCausalLM"])
MODELS = {
    # fp8 / int8: as small as a Mixtral gets (GQA, 4 experts top-2, 2 layers)
    "tiny": dict(COMMON, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                 num_experts_per_tok=2, vocab_size=64),
    # int4_awq at tp=2: modelopt's exporter wants hidden / tp, attention width / tp and
    # intermediate / tp to be multiples of the AWQ block (128); one KV head (duplicated at tp=2)
    "awq": dict(COMMON, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=2, head_dim=128, num_key_value_heads=1,
                num_local_experts=2, num_experts_per_tok=2, vocab_size=64),
}
# case -> (model, moepipe format, kv cache, tensor-parallel sizes of the oracle, experts)
CASES = {
    "fp8": ("tiny", "fp8", "none", (1, 2), None),
    "fp8_kv": ("tiny", "fp8", "fp8", (1, 2), None),
    "int8_sq": ("tiny", "int8_sq", "none", (1, 2), None),
    "int4_awq": ("awq", "int4_awq", "none", (1, 2), None),
    # modelopt's stock SmoothQuant (routed experts quantized): what `moepipe convert` refuses
    "int8_sq_experts": ("tiny", "int8_sq", "none", (), True),
}
EXPERT_NAMES = ("w1", "w3", "w2")  # Mixtral: (gate, up, down)
SEED, CALIB_SEQS, CALIB_LEN, BATCH = 1234, 16, 32, 4
SMALL = 1024  # bytes: 16-bit tensors up to this size (norms, pre-quant scales) keep their values
UNIFIED_FILES = ("config.json", "hf_quant_config.json", "model.safetensors")


def calibrated(model_name: str, fmt: str, kv: str, quantize_experts: bool | None):
    """The seeded tiny model, calibrated in float32 and cast to bfloat16 (as moepipe's
    quantize stage does for a bfloat16 checkpoint)."""
    import modelopt.torch.quantization as mtq
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(SEED)
    config = MixtralConfig(**MODELS[model_name])
    config.torch_dtype = torch.bfloat16
    model = MixtralForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    calib = torch.randint(3, config.vocab_size, (CALIB_SEQS, CALIB_LEN), generator=gen)

    def forward_loop(m):
        with torch.no_grad():
            for i in range(0, CALIB_SEQS, BATCH):
                m(input_ids=calib[i:i + BATCH])

    mtq.quantize(model, quant_config(fmt, kv, quantize_experts=quantize_experts), forward_loop)
    return model.to(torch.bfloat16)


def tensor_record(t: torch.Tensor) -> dict:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    rec = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
           "sha256": hashlib.sha256(raw).hexdigest()}
    if t.dtype == torch.float32 or (t.dtype in (torch.bfloat16, torch.float16)
                                    and len(raw) <= SMALL):
        rec["raw"] = base64.b64encode(raw).decode()
    return rec


def oracle_record(folder: Path, tp: int) -> dict:
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization") or {}
    if isinstance(quant.get("exclude_modules"), list):  # written from a set: any order
        quant["exclude_modules"] = sorted(quant["exclude_modules"])
    ranks = []
    for rank in range(tp):
        tensors = load_file(folder / f"rank{rank}.safetensors")
        ranks.append({name: tensor_record(t) for name, t in sorted(tensors.items())})
    return {"config": config, "ranks": ranks}


def make_case(name: str, out: Path, full: Path | None) -> None:
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    model_name, fmt, kv, tps, experts = CASES[name]
    model = calibrated(model_name, fmt, kv, experts)
    case = out / name
    shutil.rmtree(case, ignore_errors=True)
    case.mkdir(parents=True)
    for tp in tps:  # the oracle: modelopt's TensorRT-LLM exporter on the calibrated model
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            export_tensorrt_llm_checkpoint(copy.deepcopy(model), "llama", torch.bfloat16,
                                           export_dir=folder, inference_tensor_parallel=tp)
            record = oracle_record(folder, tp)
            if full is not None:
                shutil.copytree(folder, full / name / f"trtllm-tp{tp}", dirs_exist_ok=True)
        (case / f"oracle-tp{tp}.json").write_text(json.dumps(record, indent=1, sort_keys=True)
                                                 + "\n")
    # moepipe's quantize stage: the same fusion steps, then the unified export
    with tempfile.TemporaryDirectory() as tmp:
        export_unified(copy.deepcopy(model), Path(tmp), EXPERT_NAMES)
        (case / "unified").mkdir()
        for file in UNIFIED_FILES:
            shutil.copy2(Path(tmp) / file, case / "unified" / file)


def main(argv: list[str] | None = None) -> int:
    import modelopt
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "oracle" / "golden")
    parser.add_argument("--full", type=Path, help="also keep the TensorRT-LLM checkpoints here")
    parser.add_argument("cases", nargs="*", help=f"default: all of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    warnings.filterwarnings("ignore")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.cases or CASES:
        print(f"oracle: {name}", flush=True)
        make_case(name, args.out, args.full)
    versions = {"modelopt": modelopt.__version__, "transformers": transformers.__version__,
                "torch": torch.__version__, "seed": SEED, "models": MODELS,
                "cases": {k: list(v[1:4]) for k, v in CASES.items()}}
    (args.out / "versions.json").write_text(json.dumps(versions, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
