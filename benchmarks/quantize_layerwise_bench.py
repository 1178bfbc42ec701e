"""Layer-by-layer quantization: peak host memory against model depth.

Synthetic bfloat16 Mixtral-shaped checkpoints of one layer shape with 2, 8 and 32 decoder layers
(the deepest several GB) are quantized by ``moepipe.quant.layerwise`` exactly as the quantize
stage runs it, each in a fresh process; the table gives the checkpoint size, peak RSS (the
child's own high-water mark, ``VmHWM``), seconds per decoder layer and calibration tokens per
second through a layer (calibration tokens / the median seconds of a layer, which include
loading it, calibrating and exporting it and writing its shard), the peak over the RSS after
the imports (torch, transformers, modelopt), and the growth of peak RSS per
added layer against the float32 size of one decoder layer, the baseline of the same run.

Target: peak RSS grows by at most 0.5x one float32 decoder layer per added layer.
``--whole N,...`` also quantizes those depths with the former whole-model path
(``tests/e2e/quant_reference.py``), for contrast.

    python benchmarks/quantize_layerwise_bench.py [--layers 2,8,32] [--shape small|mixtral-8x7b]
        [--format fp8] [--kv-cache none] [--samples 32] [--seq-len 64] [--device cpu]
        [--whole 2,8] [--workdir DIR] [--keep]

``--shape mixtral-8x7b --layers 2`` measures Mixtral-8x7B's own decoder layer (the peak does
not depend on the depth, which the default shape shows).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from convert_bench import write_shards  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    experts: int
    heads: int
    kv_heads: int
    vocab: int


SHAPES = {
    # the default: one decoder layer of 90.7 M parameters (346 MiB in float32)
    "small": Shape(1024, 3584, 8, 8, 2, 32000),
    # Mixtral-8x7B's own layer (1.45 G parameters, 5.4 GiB in float32) and vocabulary
    "mixtral-8x7b": Shape(4096, 14336, 8, 32, 8, 32000),
}


def layer_tensors(shape: Shape, i: int) -> list[tuple[str, tuple[int, ...]]]:
    p = f"model.layers.{i}."
    h, hd = shape.hidden, shape.hidden // shape.heads
    out = [(p + "input_layernorm.weight", (h,)),
           (p + "post_attention_layernorm.weight", (h,)),
           (p + "self_attn.q_proj.weight", (h, h)),
           (p + "self_attn.k_proj.weight", (shape.kv_heads * hd, h)),
           (p + "self_attn.v_proj.weight", (shape.kv_heads * hd, h)),
           (p + "self_attn.o_proj.weight", (h, h)),
           (p + "block_sparse_moe.gate.weight", (shape.experts, h))]
    for e in range(shape.experts):
        q = p + f"block_sparse_moe.experts.{e}."
        out += [(q + "w1.weight", (shape.inter, h)), (q + "w3.weight", (shape.inter, h)),
                (q + "w2.weight", (h, shape.inter))]
    return out


def layer_params(shape: Shape) -> int:
    return sum(int(np.prod(s)) for _, s in layer_tensors(shape, 0))


def make_checkpoint(folder: Path, shape: Shape, layers: int) -> int:
    """The synthetic checkpoint (bfloat16, one shard per layer, seeded); returns its bytes."""
    folder.mkdir(parents=True)
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
              "vocab_size": shape.vocab, "hidden_size": shape.hidden,
              "intermediate_size": shape.inter, "num_hidden_layers": layers,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
              "num_local_experts": shape.experts, "num_experts_per_tok": 2,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
              "hidden_act": "silu", "dtype": "bfloat16", "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(0)
    shards = [layer_tensors(shape, i) for i in range(layers)]
    shards[0] = [("model.embed_tokens.weight", (shape.vocab, shape.hidden))] + shards[0]
    shards[-1] = shards[-1] + [("model.norm.weight", (shape.hidden,)),
                               ("lm_head.weight", (shape.vocab, shape.hidden))]

    def values(name: str, dims: tuple[int, ...]) -> np.ndarray:  # unit-variance activations
        x = rng.standard_normal(int(np.prod(dims)), dtype=np.float32)
        x *= 1.0 if "norm" in name or "embed" in name else 1 / np.sqrt(dims[-1])
        return x

    return write_shards(folder, shards, values)


def child(args: argparse.Namespace) -> None:
    """One quantization in this (fresh) process; prints its figures as JSON."""
    import warnings

    import modelopt.torch.export  # noqa: F401 - imported before the clock and the baseline
    import modelopt.torch.quantization  # noqa: F401
    import torch
    import transformers  # noqa: F401

    warnings.filterwarnings("ignore")
    imported = _status()["VmRSS"]
    source, out = Path(args.source), Path(args.out)
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    calib = torch.randint(3, vocab, (args.samples, args.seq_len), generator=gen).tolist()
    started = time.perf_counter()
    if args.path == "whole":
        sys.path.insert(0, str(ROOT / "tests" / "e2e"))
        from quant_reference import whole_model

        whole_model(source, out, args.format, args.kv_cache, calib, batch=4,
                    device=args.device)
        details: dict = {}
    else:
        from moepipe.quant.layerwise import Calibration, quantize_layerwise

        out.mkdir()
        details = quantize_layerwise(source, out, out.with_name(out.name + ".scratch"),
                                     Calibration(args.format, args.kv_cache, calib, 4,
                                                 args.device), ("w1", "w3", "w2"))
    seconds = time.perf_counter() - started
    result = {"seconds": seconds, "peak_rss": _status()["VmHWM"], "imported_rss": imported,
              "layer_seconds": details.get("layer_seconds"), "tokens": len(calib) * len(calib[0])}
    if args.device == "cuda":
        result["peak_device"] = torch.cuda.max_memory_allocated()
    print(json.dumps(result))


def _status() -> dict[str, int]:
    """This process's memory figures from /proc (bytes): VmRSS now, VmHWM its peak."""
    fields = dict(line.split(":", 1) for line in
                  Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def run(args: argparse.Namespace, path: str, source: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--source", str(source), "--out",
           str(out), "--format", args.format, "--kv-cache", args.kv_cache, "--samples",
           str(args.samples), "--seq-len", str(args.seq_len), "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{path} quantization of {source.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="2,8,32")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--whole", default="", help="depths also run by the whole-model path")
    parser.add_argument("--format", default="fp8")
    parser.add_argument("--kv-cache", default="none")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--child", choices=("layerwise", "whole"))
    parser.add_argument("--source")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        args.path = args.child
        return child(args)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="moepipe-qbench-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    f32_layer = 4 * layer_params(shape)
    depths = [int(n) for n in args.layers.split(",")]
    whole = [int(n) for n in args.whole.split(",") if n]
    print(f"# {args.format} (kv {args.kv_cache}), {args.samples} x {args.seq_len} calibration "
          f"tokens on {args.device}; {args.shape} decoder layer {layer_params(shape) / 1e6:.1f} M "
          f"parameters "
          f"= {f32_layer / 2**20:.0f} MiB in float32", flush=True)
    print(f"{'path':10} {'layers':>6} {'ckpt GiB':>9} {'peak RSS GiB':>13} "
          f"{'over imports':>13} {'s/layer':>8} {'tokens/s':>9} {'total s':>8}")
    rows: dict[tuple[str, int], dict] = {}
    try:
        for n in sorted(set(depths) | set(whole)):
            source = work / f"{args.shape}-{n}"
            size = make_checkpoint(source, shape, n) if not source.exists() else \
                sum(p.stat().st_size for p in source.glob("*.safetensors"))
            for path in ("layerwise", "whole"):
                if n not in (depths if path == "layerwise" else whole):
                    continue
                out = work / f"out-{path}-{n}"
                shutil.rmtree(out, ignore_errors=True)
                r = rows[path, n] = run(args, path, source, out)
                # the median: the first layer also pays modelopt's lazy imports
                per_layer = float(np.median(r["layer_seconds"])) if r["layer_seconds"] else \
                    float("nan")
                over = (r["peak_rss"] - r["imported_rss"]) / 2**30
                print(f"{path:10} {n:6d} {size / 2**30:9.2f} {r['peak_rss'] / 2**30:13.2f} "
                      f"{over:13.2f} {per_layer:8.2f} {r['tokens'] / per_layer:9.0f} "
                      f"{r['seconds']:8.1f}", flush=True)
                if "peak_device" in r:
                    print(f"{'':10} {n:6d} peak device {r['peak_device'] / 2**30:.2f} GiB",
                          flush=True)
                shutil.rmtree(out, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(source, ignore_errors=True)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    for path, names in (("layerwise", depths), ("whole", whole)):
        if len(names) < 2:
            continue
        lo, hi = min(names), max(names)
        growth = (rows[path, hi]["peak_rss"] - rows[path, lo]["peak_rss"]) / (hi - lo)
        verdict = "" if path == "whole" else \
            f" (target <= 0.5: {'met' if growth <= 0.5 * f32_layer else 'NOT met'})"
        print(f"{path}: peak RSS grows {growth / 2**20:.0f} MiB per added layer from {lo} to "
              f"{hi} layers = {growth / f32_layer:.2f}x one float32 layer{verdict}")


if __name__ == "__main__":
    main()
