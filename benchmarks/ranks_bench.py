"""Expert parallelism as processes on the cpu target: world size 1, 2 and 4 on the same model
and load, each deployed for real (tritonserver; rank 0 in its tensorrt_llm model, the other
ranks their own processes).

    python benchmarks/ranks_bench.py [--workdir DIR] [--world-sizes 1,2,4] [--requests 48]
                                     [--concurrency 4] [--max-tokens 32] [--json FILE]

The model: a random-weight Mixtral (4 layers, hidden 512, 8 heads / 4 KV heads, 8 experts of
width 1024, top-2; 218 MB of float32 weights) with tiny-mixtral's tokenizer, converted at
tp = moe_ep = W (every rank holds 8/W experts and 8/W heads). Per world size: a warm-up, then
a closed loop of ``--requests`` streamed requests at ``--concurrency`` over gRPC (validate's
load driver), and
* tokens/s, request latency p50/p99 and TTFT p50 (ratios against W=1 of the same run);
* the communication share of a step and the wait for the slowest rank, from the deployment's
  ``moepipe_rank_*`` metrics over the load (what ``moepipe validate --job perf`` reports);
* each rank's resident memory (VmRSS of rank 0's backend process and of each worker) against
  the checkpoint size / W, next to the RSS of a bare process that imported the runtime
  (torch's own share);
* for W > 1: SIGKILL of the last worker rank, then the time until a probe request answers
  exactly as before the kill (the supervisor starts the rank group again).

Two cores are not W machines: W=4 runs four compute processes on two cores, so what scaling
can show here is the cost of the collectives and the oversubscription, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from moepipe.commands.build import run_build
from moepipe.commands.deploy import run_deploy, state_dir
from moepipe.config import load_config
from moepipe.deploy.local import lifecycle
from moepipe.deploy.local.state import read_state
from moepipe.validate import rank_figures
from moepipe.validate.base import Endpoint
from moepipe.validate.load import run_load
from moepipe.validate.stats import summarize
from moepipe.validate.workload import plan, prompts_for

MODEL = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False)
PROBE = {"text_input": "It is a truth universally acknowledged", "max_tokens": 8}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def write_model(out: Path) -> Path:
    """A random Mixtral of MODEL's size with tiny-mixtral's tokenizer (seeded)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from moepipe.arch.hf import tokenizer_files
    from moepipe.examples import write_example

    if (out / "config.json").is_file():
        return out
    tiny = write_example("tiny-mixtral", out.parent / "tiny-mixtral")
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=vocab, **MODEL)).float()
    model.save_pretrained(out, safe_serialization=True)
    for path in tokenizer_files(tiny):
        if path.name not in ("config.json", "generation_config.json"):  # the model's own
            shutil.copy2(path, out / path.name)
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def bare_runtime_rss_kib() -> int:
    """RSS of a process that imported what a worker rank imports, and nothing else."""
    code = ("import moepipe.ranks.worker, moepipe.runtime.model, torch, pathlib\n"
            "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines()"
            " if l.startswith('VmRSS:')][0].split()[1])")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.strip())


def probe(http: str) -> str | None:
    req = urllib.request.Request(f"http://{http}/v2/models/ensemble/generate",
                                 json.dumps(PROBE).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["text_output"]
    except OSError:
        return None


def one_world_size(root: Path, model: Path, world: int, args) -> dict:
    work = root / f"w{world}"
    work.mkdir(parents=True, exist_ok=True)
    http, grpc, metrics, ranks = free_ports(4)
    data = {"model": {"path": str(model)}, "target": "cpu",
            "parallel": {"tp": world, "moe_ep": world},
            "build": {"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 256},
            "deploy": {"http_port": http, "grpc_port": grpc, "metrics_port": metrics,
                       "rank_port": ranks, "ready_timeout_s": 300, "max_restarts": 2},
            "validate": {"load": {"max_tokens": args.max_tokens}},
            "workdir": str(work / "moepipe-work")}
    (work / "moepipe.yaml").write_text(yaml.safe_dump(data))
    run_build(work / "moepipe.yaml", echo=lambda s: None)
    cfg = load_config(work / "moepipe.yaml")
    ckpt_bytes = sum(p.stat().st_size for p in
                     (cfg.workdir / "artifacts").glob("convert-*/rank*.safetensors"))
    run_deploy(cfg, echo=lambda s: None)
    try:
        ep = Endpoint(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", metrics=f"127.0.0.1:{metrics}")
        prompts = prompts_for(cfg)
        run_load(plan(cfg, ep, prompts[:4], concurrency=2, max_requests=8, duration_s=60))
        before = rank_figures.scrape(ep.metrics)
        res = run_load(plan(cfg, ep, prompts, concurrency=args.concurrency,
                            max_requests=args.requests, duration_s=600))
        time.sleep(0.7)  # the model publishes its metrics every 0.5 s
        share = rank_figures.share(before, rank_figures.scrape(ep.metrics))
        s = summarize(res)
        state = read_state(state_dir(cfg))
        assert state is not None
        rank0 = (state.models or {}).get("tensorrt_llm_0_0")
        rss = {"0": rss_kib(rank0) if rank0 else None,
               **{str(r): rss_kib(pid) for r, pid in (state.ranks or {}).items()}}
        row = {"world_size": world, "mapping": f"tp={world} moe_ep={world}",
               "requests": s["requests"], "errors": s["failed"] + s["timeout"] + s["rejected"],
               "output_tokens_per_s": s["output_tokens_per_s"],
               "latency_p50_ms": s["latency_ms"]["p50"], "latency_p99_ms": s["latency_ms"]["p99"],
               "ttft_p50_ms": s["ttft_ms"]["p50"],
               "communication_share": share["communication_share"] if share else 0.0,
               "wait_for_slowest_ms": share["wait_for_slowest_ms"] if share else 0.0,
               "step_ms": share["step_ms"] if share else None,
               "ranks": share["ranks"] if share else None,
               "rss_mib": {r: None if v is None else round(v / 1024, 1) for r, v in rss.items()},
               "checkpoint_mib_per_rank": round(ckpt_bytes / world / 2**20, 1)}
        if world > 1 and args.recovery:
            expected = probe(ep.http)
            victim = state.ranks[max(state.ranks)] if state.ranks else None
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            back = None
            while time.monotonic() - killed < 120:
                if probe(ep.http) == expected:
                    back = time.monotonic() - killed
                    break
                time.sleep(0.05)
            row["recovery_s"] = None if back is None else round(back, 2)
        return row
    finally:
        lifecycle.stop(state_dir(cfg), grace=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/moepipe-ranks-bench"))
    p.add_argument("--world-sizes", default="1,2,4")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-recovery", dest="recovery", action="store_false")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = write_model(args.workdir / "model")
    bare = bare_runtime_rss_kib()
    rows = [one_world_size(args.workdir, model, int(w), args)
            for w in args.world_sizes.split(",")]
    base = rows[0]
    print(f"bare runtime process (python + torch + moepipe.runtime): {bare / 1024:.0f} MiB RSS; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| W | tokens/s (x W=1) | latency p50 / p99 ms | TTFT p50 ms | step ms | "
          "communication share | wait for slowest ms | RSS per rank MiB | ckpt / W MiB | "
          "recovery s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        rss = " / ".join(f"{v:.0f}" for v in r["rss_mib"].values() if v is not None)
        print(f"| {r['world_size']} | {r['output_tokens_per_s']:.0f} ({ratio:.2f}) | "
              f"{r['latency_p50_ms']:.0f} / {r['latency_p99_ms']:.0f} | {r['ttft_p50_ms']:.0f} | "
              f"{r['step_ms'] or 0:.1f} | {r['communication_share']:.0%} | "
              f"{r['wait_for_slowest_ms']:.2f} | {rss} | {r['checkpoint_mib_per_rank']:.0f} | "
              f"{r.get('recovery_s', '-')} |")
    if args.json:
        args.json.write_text(json.dumps({"bare_rss_mib": round(bare / 1024, 1), "rows": rows,
                                         "median_tokens_per_s": statistics.median(
                                             r["output_tokens_per_s"] for r in rows)},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
