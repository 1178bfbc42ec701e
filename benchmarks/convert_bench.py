"""Conversion benchmark: a synthetic Mixtral-shaped checkpoint (>= 2 GB, several shards) is
converted at tp=1 and at tp=4/moe_ep=2; each run is timed against `cp -r` of the same input in
the same run, and its peak RSS is compared with the largest layer's bytes.

    python benchmarks/convert_bench.py [--gb 2.2] [--repeat 3] [--workdir DIR] [--keep]
        [--reuse-input] [--rows cold-fresh,warm-fresh,warm-hashed] [--mappings both|tp1]

Each pair (cp, then convert) runs "cold" (page cache dropped before each command, as for a
checkpoint that lives on disk - needs root; skipped otherwise) and "warm" (input already in
RAM), as a first conversion ("fresh": the input is hashed for the manifest) and with the input
digests remembered by a previous run ("hashed", as in a rebuild). Every pair is repeated
--repeat times; the table gives the ratio's range, CPU seconds (user + system) per GB of both
commands and the load average around the pairs (the ratio depends on it on a shared machine).
Targets: first conversion (fresh) <= 1.5x `cp -r` cold and warm; peak RSS <= 2x the largest
layer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from moepipe.checkpoints.casts import convert_bytes
from moepipe.checkpoints.dtypes import BF16, F32
from moepipe.checkpoints.writer import SafetensorsWriter

HIDDEN, INTER, EXPERTS, HEADS, KV_HEADS, VOCAB = 2048, 4096, 8, 16, 4, 32000


def layer_tensors(i: int) -> list[tuple[str, tuple[int, ...]]]:
    p = f"model.layers.{i}."
    hd = HIDDEN // HEADS
    out = [(p + "input_layernorm.weight", (HIDDEN,)),
           (p + "post_attention_layernorm.weight", (HIDDEN,)),
           (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
           (p + "self_attn.k_proj.weight", (KV_HEADS * hd, HIDDEN)),
           (p + "self_attn.v_proj.weight", (KV_HEADS * hd, HIDDEN)),
           (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
           (p + "block_sparse_moe.gate.weight", (EXPERTS, HIDDEN))]
    for e in range(EXPERTS):
        q = p + f"block_sparse_moe.experts.{e}."
        out += [(q + "w1.weight", (INTER, HIDDEN)), (q + "w3.weight", (INTER, HIDDEN)),
                (q + "w2.weight", (HIDDEN, INTER))]
    return out


def nbytes(entries) -> int:
    return sum(2 * int(np.prod(s)) for _, s in entries)


def make_checkpoint(folder: Path, target_bytes: float) -> tuple[int, int]:
    """Write the synthetic checkpoint (bf16, one shard per layer); returns (bytes, layer bytes)."""
    folder.mkdir(parents=True)
    layer_bytes = nbytes(layer_tensors(0))
    layers = max(2, int(target_bytes // layer_bytes) + 1)
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
              "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": layers, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "num_local_experts": EXPERTS,
              "num_experts_per_tok": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 1e6, "hidden_act": "silu", "torch_dtype": "bfloat16",
              "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(0)
    shards = [layer_tensors(i) for i in range(layers)]
    shards[0] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))] + shards[0]
    shards[-1] = shards[-1] + [("model.norm.weight", (HIDDEN,)),
                               ("lm_head.weight", (VOCAB, HIDDEN))]
    total = write_shards(folder, shards, lambda name, shape: rng.standard_normal(
        int(np.prod(shape)), dtype=np.float32) * 0.02)
    return total, layer_bytes


def write_shards(folder: Path, shards: list[list[tuple[str, tuple[int, ...]]]],
                 values: Callable[[str, tuple[int, ...]], np.ndarray]) -> int:
    """Write one bf16 shard per list of (name, shape), each tensor from ``values(name,
    shape)`` (float32, flat), and the index; returns the bytes written."""
    weight_map, total = {}, 0
    for i, entries in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsWriter(folder / name, [(n, BF16, s) for n, s in entries])
        for tensor_name, shape in entries:
            data = values(tensor_name, shape)
            writer.write_bytes(convert_bytes(memoryview(data).cast("B"), F32, BF16))
            weight_map[tensor_name] = name
        writer.close()
        total += (folder / name).stat().st_size
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (root only); False if not possible."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str], cold: bool = False) -> tuple[float, float, int]:
    """Run ``cmd``; return (seconds, CPU seconds (user + system), peak RSS bytes).

    The peak RSS comes from GNU time when present: Linux carries a parent's RSS over into the
    ru_maxrss of children it forks, so this process's own wait4() would overstate it.
    """
    if cold:
        drop_caches()
    else:
        subprocess.run(["sync"], check=True)
    gnu_time = Path("/usr/bin/time")
    report = Path(os.environ.get("TMPDIR", "/tmp")) / f"moepipe-bench-{os.getpid()}.rss"
    wrapped = [str(gnu_time), "-f", "%M", "-o", str(report), *cmd] if gnu_time.exists() \
        else cmd
    start = time.perf_counter()
    proc = subprocess.Popen(wrapped)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"command failed: {' '.join(cmd)}")
    cpu = usage.ru_utime + usage.ru_stime  # includes GNU time's waited-for child
    if gnu_time.exists():
        kb = int(report.read_text().split()[-1])
        report.unlink()
        return seconds, cpu, kb * 1024
    return seconds, cpu, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.2, help="input size in GB (>= 2)")
    ap.add_argument("--repeat", type=int, default=3, help="pairs per row (ratio range)")
    ap.add_argument("--mappings", choices=("both", "tp1"), default="both")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moepipe-convert-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--reuse-input", action="store_true",
                    help="reuse the input a --keep run left in --workdir (same --gb)")
    ap.add_argument("--rows", default="cold-fresh,warm-fresh,warm-hashed",
                    help="comma-separated rows to measure (pages-input)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    src = args.workdir / "hf"
    if args.reuse_input and (src / "config.json").is_file():
        total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        layer = nbytes(layer_tensors(0))
        for stale in ("copy", "out"):
            shutil.rmtree(args.workdir / stale, ignore_errors=True)
    else:
        if args.workdir.exists():
            shutil.rmtree(args.workdir)
        total, layer = make_checkpoint(src, args.gb * 1e9)
    gb = total / 1e9
    print(f"input: {gb:.2f} GB in {len(list(src.glob('*.safetensors')))} shards, "
          f"largest layer {layer / 1e6:.0f} MB")
    moepipe = [sys.executable, "-m", "moepipe", "-q", "convert", "--model", str(src)]
    results = []
    can_drop = drop_caches()
    wanted = args.rows.split(",")
    runs = [tuple(r.split("-")) for r in wanted if can_drop or not r.startswith("cold")]
    mappings = [("tp=1", [])]
    if args.mappings == "both":
        mappings.append(("tp=4 moe_ep=2", ["--tp", "4", "--moe-ep", "2"]))
    for label, extra in mappings:
        for cache, digests in runs:
            for _ in range(args.repeat):
                hash_cache = args.workdir / f"hash-cache-{label.split()[0]}"
                if digests == "fresh":  # a first conversion: nothing remembered
                    shutil.rmtree(hash_cache, ignore_errors=True)
                else:  # remembered by a conversion of the same input before
                    os.environ["MOEPIPE_CACHE_DIR"] = str(hash_cache)
                    if not hash_cache.exists():
                        timed(moepipe + ["--output", str(args.workdir / "out")] + extra)
                        shutil.rmtree(args.workdir / "out")
                os.environ["MOEPIPE_CACHE_DIR"] = str(hash_cache)
                if cache == "warm":
                    for f in src.iterdir():
                        f.read_bytes()
                load = os.getloadavg()[0]
                cp_s, cp_cpu, _ = timed(["cp", "-r", str(src), str(args.workdir / "copy")],
                                        cache == "cold")
                conv_s, conv_cpu, rss = timed(
                    moepipe + ["--output", str(args.workdir / "out")] + extra, cache == "cold")
                shutil.rmtree(args.workdir / "copy")
                shutil.rmtree(args.workdir / "out")
                results.append({"mapping": label, "cache": cache, "input_digests": digests,
                                "convert_s": conv_s, "cp_s": cp_s, "ratio": conv_s / cp_s,
                                "convert_cpu_s_per_gb": conv_cpu / gb,
                                "cp_cpu_s_per_gb": cp_cpu / gb, "load_avg_1min": load,
                                "peak_rss_bytes": rss, "largest_layer_bytes": layer,
                                "rss_over_layer": rss / layer, "input_bytes": total})
    print(f"{'mapping':14} {'pages':5} {'input':6} {'convert s':>11} {'cp -r s':>11} "
          f"{'ratio':>11} {'CPU s/GB conv':>13} {'cp':>9} {'load':>9} {'RSS/layer':>9}")
    rows: dict[tuple, list[dict]] = {}
    for r in results:
        rows.setdefault((r["mapping"], r["cache"], r["input_digests"]), []).append(r)

    def span(rs, key, fmt="{:.2f}"):
        lo, hi = min(r[key] for r in rs), max(r[key] for r in rs)
        return fmt.format(lo) if len(rs) == 1 else f"{fmt.format(lo)}-{fmt.format(hi)}"

    ok = all(r["rss_over_layer"] <= 2.0 for r in results)
    for (mapping, cache, digests), rs in rows.items():
        print(f"{mapping:14} {cache:5} {digests:6} {span(rs, 'convert_s'):>11} "
              f"{span(rs, 'cp_s'):>11} {span(rs, 'ratio'):>11} "
              f"{span(rs, 'convert_cpu_s_per_gb'):>13} {span(rs, 'cp_cpu_s_per_gb'):>9} "
              f"{span(rs, 'load_avg_1min', '{:.1f}'):>9} "
              f"{max(r['rss_over_layer'] for r in rs):9.2f}")
        if digests == "fresh":
            ok = ok and min(r["ratio"] for r in rs) <= 1.5
    print("targets (first conversion <= 1.5x cp -r (best of the repeats), cold and warm; "
          "peak RSS <= 2x largest layer):", "MET" if ok else "NOT MET")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if not args.keep:
        shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
