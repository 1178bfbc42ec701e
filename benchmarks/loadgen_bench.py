"""moepipe's load driver against NVIDIA AIPerf on the same endpoint, load and prompts.

    python benchmarks/loadgen_bench.py [--aiperf /path/to/venv/bin/aiperf] [--requests 64]
                                       [--concurrency 1,4] [--max-tokens 16]

Deploys tiny-mixtral (tp=1) on the cpu target, then for each concurrency runs both clients
(closed loop, streaming, the same prompts and max_tokens, both over HTTP ``/generate_stream``)
against the same server and compares what both measure the same way: request throughput,
request latency p50/p99 and time to first token p50/p99, and the CPU each client spends per
request (on a small machine the client's CPU is taken from the server). moepipe's driver over
gRPC streaming, what the validation jobs use, is shown for reference.
AIPerf reaches Triton's ``/generate_stream`` through its template endpoint; its
token counts come from re-tokenizing the streamed text (no server counts on that endpoint),
so token throughput and inter-token latency are not compared. The driver reports its own CPU
use. Target: every compared figure within 10% of AIPerf's.

AIPerf is not a moepipe dependency (it brings its own stack): install it in a separate
virtualenv (``python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf``).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE = ('{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens|tojson }}, '
            '"stream": {{ stream|lower }}}')
FIGURES = [("requests/s", "requests_per_s", ("request_throughput", "avg")),
           ("latency p50 ms", "latency_ms.p50", ("request_latency", "p50")),
           ("latency p99 ms", "latency_ms.p99", ("request_latency", "p99")),
           ("TTFT p50 ms", "ttft_ms.p50", ("time_to_first_token", "p50")),
           ("TTFT p99 ms", "ttft_ms.p99", ("time_to_first_token", "p99"))]


def run_aiperf(aiperf: str, http: str, tokenizer: Path, prompts: list[str], max_tokens: int,
               concurrency: int, requests: int, work: Path) -> dict:
    """One AIPerf profile; returns its profile_export_aiperf.json."""
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    out = work / f"aiperf-c{concurrency}"
    template = work / "template.json"  # a file: AIPerf splits inline values at commas
    template.write_text(TEMPLATE)
    cmd = [aiperf, "profile", "--model", "ensemble", "--url", f"http://{http}",
           "--custom-endpoint", "/v2/models/ensemble/generate_stream",
           "--endpoint-type", "template", "--extra-inputs", f"payload_template:{template}",
           "--extra-inputs", "response_field:text_output", "--streaming",
           "--tokenizer", str(tokenizer), "--input-file", str(data),
           "--custom-dataset-type", "single_turn", "--output-tokens-mean", str(max_tokens),
           "--output-tokens-stddev", "0", "--concurrency", str(concurrency),
           "--request-count", str(requests), "--warmup-request-count", str(concurrency),
           "--random-seed", "0", "--ui-type", "none", "--artifact-dir", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise SystemExit(f"AIPerf failed (exit {done.returncode}):\n{tail}")
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise SystemExit(f"AIPerf wrote no profile_export_aiperf.json under {out}")
    export = json.loads(found[-1].read_text())
    # AIPerf's whole process tree (workers, record processors, controller), start-up included
    export["client_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return export


def run_driver(url: str, protocol: str, prompts: list[str], max_tokens: int,
               concurrency: int, requests: int) -> dict:
    from moepipe.validate.load import LoadPlan, Prompt, run_load
    from moepipe.validate.stats import summarize

    ps = [Prompt("short", p, max_tokens) for p in prompts]
    run_load(LoadPlan(url, ps, concurrency=concurrency, max_requests=concurrency,
                      protocol=protocol))  # warm-up
    res = run_load(LoadPlan(url, ps, concurrency=concurrency, max_requests=requests,
                            duration_s=600, protocol=protocol))
    return summarize(res)


def aiperf_figure(export: dict, key: tuple[str, str]) -> float | None:
    metric = export.get(key[0]) or export.get("records", {}).get(key[0])
    if not isinstance(metric, dict):
        return None
    value = metric.get(key[1])
    return None if value is None else float(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf")
    ap.add_argument("--example", default="tiny-mixtral")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import yaml

    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.config import load_config
    from moepipe.deploy import server
    from moepipe.validate.stats import figure

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "e2e"))
    from helpers import free_ports

    work = Path(tempfile.mkdtemp(prefix="moepipe-loadgen-bench-"))
    http, grpc, metrics = free_ports(3)
    (work / "moepipe.yaml").write_text(yaml.safe_dump({
        "model": {"example": args.example},
        "build": {"max_batch_size": 16, "max_input_len": 256, "max_seq_len": 512},
        "deploy": {"http_port": http, "grpc_port": grpc, "metrics_port": metrics},
        "workdir": str(work)}))
    cfg = load_config(work / "moepipe.yaml")
    run_build(work / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    from moepipe.validate.loadjobs import short_prompts

    prompts = short_prompts(cfg, 24)
    rows = []
    try:
        for c in (int(x) for x in args.concurrency.split(",")):
            ours = run_driver(f"127.0.0.1:{http}", "http", prompts, args.max_tokens, c,
                              args.requests)
            theirs = run_aiperf(args.aiperf, f"127.0.0.1:{http}", cfg.deploy_dir / "tokenizer",
                                prompts, args.max_tokens, c, args.requests, work)
            grpc_run = run_driver(f"127.0.0.1:{grpc}", "grpc", prompts, args.max_tokens, c,
                                  args.requests)
            for label, path, key in FIGURES:
                a, b = figure(ours, path), aiperf_figure(theirs, key)
                rows.append({"concurrency": c, "figure": label, "moepipe": a, "aiperf": b,
                             "ratio": None if not a or not b else a / b,
                             "moepipe_grpc": figure(grpc_run, path)})
            rows.append({"concurrency": c, "figure": "client CPU s per request",
                         "moepipe": ours["client_cpu_max"] * ours["seconds"] / args.requests,
                         "aiperf": theirs["client_cpu_s"] / args.requests, "ratio": None,
                         "moepipe_grpc": grpc_run["client_cpu_max"] * grpc_run["seconds"]
                         / args.requests})
    finally:
        server.stop(state_dir(cfg))
    print(f"{args.example} tp=1, {args.requests} requests x {args.max_tokens} tokens, "
          "streaming, closed loop")
    print("both over HTTP /generate_stream (moepipe's driver over gRPC streaming for reference)")
    print(f"{'conc':>4} | {'figure':<28} | {'moepipe':>9} | {'aiperf':>9} | ratio | "
          f"{'moepipe gRPC':>12}")
    worst = 0.0
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:9.3f}"  # noqa: E731
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{r['concurrency']:>4} | {r['figure']:<28} | {fmt(r['moepipe'])} | "
              f"{fmt(r['aiperf'])} | {ratio:>5} | {fmt(r['moepipe_grpc']):>12}")
        if r["ratio"] is not None:
            worst = max(worst, abs(r["ratio"] - 1))
    print(f"target (every compared figure within 10% of AIPerf's): "
          f"{'MET' if worst <= 0.10 else 'NOT MET'} (largest difference {worst:.1%})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
