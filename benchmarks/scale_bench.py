"""Converter cost per tensor at DeepSeek scale: synthetic Qwen3-MoE-family checkpoints of 61
layers with 16, 64 and 256 experts (1x, 4x, 16x the tensors; 256 x 61 is DeepSeek-V3's expert
grid) and tiny dimensions, so that the per-tensor work (header parsing, planning, validation,
one read and one write per slice) is what is measured, not bandwidth.

    python benchmarks/scale_bench.py [--workdir DIR] [--json FILE] [--keep]

Times, in this process: opening the checkpoint (headers parsed and validated), planning every
rank (tp=2, moe_ep=2) with the unmapped-tensor check, and the whole conversion. Target: time per
tensor at 4x and 16x within 1.5x of 1x (cost linear in the number of tensors). The best of
several runs is kept: on a shared machine the others measure the neighbours.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from moepipe.arch.hf import open_hf_checkpoint
from moepipe.checkpoints.dtypes import BF16
from moepipe.checkpoints.writer import SafetensorsWriter
from moepipe.conversion.plan import plan_conversion, unmapped_tensors
from moepipe.conversion.write import convert_checkpoint
from moepipe.mapping import Mapping

LAYERS, HIDDEN, INTER, HEADS, KV, HEAD_DIM, VOCAB = 61, 64, 32, 4, 2, 16, 512
SCALES = {"1x": 16, "4x": 64, "16x": 256}
MAPPING = dict(tp=2, moe_ep=2)


def tensors(experts: int) -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN)), ("model.norm.weight", (HIDDEN,)),
           ("lm_head.weight", (VOCAB, HIDDEN))]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        out += [(p + "input_layernorm.weight", (HIDDEN,)),
                (p + "post_attention_layernorm.weight", (HIDDEN,)),
                (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.k_proj.weight", (KV * HEAD_DIM, HIDDEN)),
                (p + "self_attn.v_proj.weight", (KV * HEAD_DIM, HIDDEN)),
                (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
                (p + "self_attn.q_norm.weight", (HEAD_DIM,)),
                (p + "self_attn.k_norm.weight", (HEAD_DIM,)),
                (p + "mlp.gate.weight", (experts, HIDDEN))]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (INTER, HIDDEN)),
                    (q + "up_proj.weight", (INTER, HIDDEN)),
                    (q + "down_proj.weight", (HIDDEN, INTER))]
    return out


def make_checkpoint(folder: Path, experts: int) -> int:
    """Write the synthetic checkpoint (one bf16 shard); returns its tensor count."""
    folder.mkdir(parents=True)
    config = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                  moe_intermediate_size=INTER, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
                  num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
                  torch_dtype="bfloat16", max_position_embeddings=2048, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=False, decoder_sparse_step=1,
                  mlp_only_layers=[], hidden_act="silu")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    entries = tensors(experts)
    writer = SafetensorsWriter(folder / "model.safetensors", [(n, BF16, s) for n, s in entries])
    rng = np.random.default_rng(0)
    for _, shape in entries:
        bits = rng.integers(0x3C00, 0x3F00, size=int(np.prod(shape)), dtype=np.uint16)
        writer.write_bytes(memoryview(bits).cast("B"))
    writer.close()
    return len(entries)


def measure(src: Path, out: Path, convert: bool) -> dict[str, float]:
    mapping = Mapping.create(**MAPPING)
    start = time.perf_counter()
    ckpt = open_hf_checkpoint(src)
    with ckpt.reader() as reader:
        opened = time.perf_counter()
        plan = plan_conversion(ckpt.family, ckpt.spec, mapping, "bfloat16", reader)
        if unmapped_tensors(plan, reader.tensors, ckpt.family):
            sys.exit("synthetic checkpoint has unmapped tensors")
        planned = time.perf_counter()
    result = {"open_s": opened - start, "plan_s": planned - opened}
    if convert:
        convert_checkpoint(open_hf_checkpoint(src), out, mapping, dtype="bfloat16")
        result["convert_s"] = time.perf_counter() - planned
        shutil.rmtree(out)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moepipe-scale-bench"))
    ap.add_argument("--repeat", type=int, default=3, help="runs per scale (best is kept)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    results = []
    for label, experts in SCALES.items():
        src = args.workdir / f"hf-{experts}"
        count = make_checkpoint(src, experts)
        # opening and planning are cheap: more runs; the best run is the least disturbed
        runs = [measure(src, args.workdir / "out", i < args.repeat)
                for i in range(3 * args.repeat)]
        best = {k: min(r[k] for r in runs if k in r) for k in runs[0]}
        results.append({"scale": label, "experts": experts, "layers": LAYERS, "tensors": count,
                        **best, **{k.replace("_s", "_us_per_tensor"): v / count * 1e6
                                   for k, v in best.items()}})
    print(f"{'scale':5} {'tensors':>8} {'open us/t':>9} {'plan us/t':>9} {'convert us/t':>12}")
    for r in results:
        print(f"{r['scale']:5} {r['tensors']:8d} {r['open_us_per_tensor']:9.1f} "
              f"{r['plan_us_per_tensor']:9.1f} {r['convert_us_per_tensor']:12.1f}")
    # growth of the per-tensor time from 1x to 4x and 16x (a cost linear in the number of
    # tensors keeps it at 1; fixed costs spread over more tensors bring it below 1)
    spread = {k: max(r[k] for r in results[1:]) / results[0][k]
              for k in ("open_us_per_tensor", "plan_us_per_tensor", "convert_us_per_tensor")}
    print("per-tensor time at 4x/16x over 1x (worst): "
          + ", ".join(f"{k.split('_')[0]} {v:.2f}" for k, v in spread.items()))
    print("target (per-tensor time flat within 1.5x):",
          "MET" if all(v <= 1.5 for v in spread.values()) else "NOT MET")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "spread": spread}, indent=2))
    if not args.keep:
        shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
