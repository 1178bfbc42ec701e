"""Serving benchmark: output tokens/s and p50/p99 request latency at concurrency 1, 4 and 16
through the deployed ensemble (a real tritonserver, cpu target), against transformers
``generate`` on the same model and prompts in the same run, batched at the same sizes.

    python benchmarks/serve_bench.py [--example tiny-mixtral] [--requests 48] [--max-tokens 32]

With ``--url HOST:PORT`` (HTTP; ``--grpc-url`` defaults to the next port) it measures an
existing deployment of any target instead: streamed requests through HTTP ``generate_stream``
and the gRPC stream API, reporting time to first token (TTFT), inter-token latency (ITL),
tokens/s and each level's tokens/s relative to concurrency 1 of the same protocol.

    python benchmarks/serve_bench.py --url 127.0.0.1:8000 [--requests 48] [--max-tokens 32]

Both sides use the same number of torch threads (--threads, default 1). Target: at
concurrency 16 the server reaches >= 1.0x the transformers tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def percentile(values, q):
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def prompts_from_corpus(n: int) -> list[str]:
    from moepipe.examples import corpus_text

    lines = [s.strip() for s in corpus_text().replace("\n", " ").split(".") if len(s) > 20]
    return [lines[i % len(lines)][: 40 + 13 * (i % 7)] for i in range(n)]


def bench_server(grpc_url: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    from moepipe.validate import client

    latencies, tokens = [], []
    lock = threading.Lock()
    todo = list(enumerate(prompts))

    streams = [client.GrpcStream(grpc_url) for _ in range(concurrency)]  # one per user

    def worker(stream):
        while True:
            with lock:
                if not todo:
                    return
                _, prompt = todo.pop()
            start = time.perf_counter()
            res = stream.infer("ensemble", client.text_inputs(prompt, max_tokens,
                                                              exclude_input_in_output=True,
                                                              return_num_output_tokens=True),
                               ["text_output", "num_output_tokens"])
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                tokens.append(int(res.outputs[-1]["num_output_tokens"].reshape(-1)[0]))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for s in streams:
        s.close()
    return {"tokens": sum(tokens), "seconds": wall, "tokens_per_s": sum(tokens) / wall,
            "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99)}


def _stream_http(url: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times (s after sending) of every SSE event of one /generate_stream request."""
    import urllib.request

    payload = {"text_input": prompt, "max_tokens": max_tokens, "stream": True,
               "exclude_input_in_output": True}
    req = urllib.request.Request(f"http://{url}/v2/models/ensemble/generate_stream",
                                 data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    start, times = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:"):
                if "error" in json.loads(line[5:]):
                    raise RuntimeError(line[5:])
                times.append(time.perf_counter() - start)
    return times


class _GrpcStreamer:
    """One gRPC stream per user; ``run`` gives the arrival times of one streamed request."""

    def __init__(self, url: str):
        import queue

        import tritonclient.grpc as grpcclient

        self.g, self.q = grpcclient, queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.q.put(
            (time.perf_counter(), result, error)))

    def run(self, prompt: str, max_tokens: int) -> list[float]:
        g = self.g
        inputs = {"text_input": np.array([[prompt.encode()]], dtype=object),
                  "max_tokens": np.array([[max_tokens]], np.int32),
                  "stream": np.array([[True]]), "exclude_input_in_output": np.array([[True]])}
        tensors = []
        for name, value in inputs.items():
            t = g.InferInput(name, list(value.shape),
                             {"O": "BYTES", "i": "INT32", "b": "BOOL"}[value.dtype.kind])
            t.set_data_from_numpy(value)
            tensors.append(t)
        start, times = time.perf_counter(), []
        self.client.async_stream_infer("ensemble", tensors, enable_empty_final_response=True)
        while True:
            when, result, error = self.q.get(timeout=120)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.outputs:
                times.append(when - start)
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return times

    def close(self):
        self.client.stop_stream()
        self.client.close()


def bench_url(http_url: str, grpc_url: str, prompts: list[str], max_tokens: int,
              concurrency: int, protocol: str) -> dict:
    """Streamed requests against a running deployment: TTFT, inter-token latency, tokens/s."""
    ttft, itl, latency, tokens = [], [], [], []
    lock = threading.Lock()
    todo = list(prompts)

    def worker():
        streamer = _GrpcStreamer(grpc_url) if protocol == "grpc" else None
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    prompt = todo.pop()
                times = streamer.run(prompt, max_tokens) if streamer else \
                    _stream_http(http_url, prompt, max_tokens)
                with lock:
                    ttft.append(times[0])
                    itl.extend(b - a for a, b in zip(times, times[1:], strict=False))
                    latency.append(times[-1])
                    tokens.append(len(times))  # one streamed response per token
        finally:
            if streamer:
                streamer.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ms = 1000.0
    return {"protocol": protocol, "concurrency": concurrency, "requests": len(latency),
            "tokens_per_s": round(sum(tokens) / wall, 1),
            "ttft_ms_p50": round(percentile(ttft, 50) * ms, 2),
            "ttft_ms_p99": round(percentile(ttft, 99) * ms, 2),
            "itl_ms_p50": round(percentile(itl, 50) * ms, 2),
            "itl_ms_p99": round(percentile(itl, 99) * ms, 2),
            "latency_ms_p50": round(percentile(latency, 50) * ms, 2)}


def bench_transformers(model_dir: Path, prompts: list[str], max_tokens: int,
                       batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    latencies, tokens = [], 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        enc = tok(chunk, return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id)
        elapsed = time.perf_counter() - t0
        for row in out[:, enc.input_ids.shape[1]:].tolist():
            n = row.index(eos) + 1 if eos in row else len(row)
            tokens += n
        latencies += [elapsed] * len(chunk)
    wall = time.perf_counter() - start
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", default="tiny-mixtral")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--moe-ep", type=int, default=None)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--url", help="HOST:PORT (HTTP) of a running deployment to measure")
    ap.add_argument("--grpc-url", help="HOST:PORT (gRPC); default: --url's port + 1")
    args = ap.parse_args()
    if args.url:
        run_url(args)
        return

    import torch
    import yaml

    torch.set_num_threads(args.threads)
    from moepipe.commands.build import model_dir, run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.config import load_config
    from moepipe.deploy.local import binary, lifecycle

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "e2e"))
    from helpers import free_ports

    work = Path(tempfile.mkdtemp(prefix="moepipe-serve-bench-"))
    http, grpc, metrics = free_ports(3)
    (work / "moepipe.yaml").write_text(yaml.safe_dump({
        "model": {"example": args.example},
        "parallel": {"tp": args.tp, "moe_ep": args.moe_ep},
        "build": {"max_batch_size": 16, "max_input_len": 256, "max_seq_len": 512},
        "deploy": {"http_port": http, "grpc_port": grpc, "metrics_port": metrics,
                   "cpu_threads": args.threads}, "workdir": str(work)}))
    cfg = load_config(work / "moepipe.yaml")
    run_build(work / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    prompts = prompts_from_corpus(args.requests)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    try:
        bench_server(f"127.0.0.1:{grpc}", prompts[:4], args.max_tokens, 4)  # warm-up
        for c in levels:
            srv = bench_server(f"127.0.0.1:{grpc}", prompts, args.max_tokens, c)
            ref = bench_transformers(model_dir(cfg), prompts, args.max_tokens, c)
            rows.append({"concurrency": c, "server": srv, "transformers": ref,
                         "speedup": srv["tokens_per_s"] / ref["tokens_per_s"]})
    finally:
        lifecycle.stop(state_dir(cfg))
    log = (state_dir(cfg) / binary.LOG_FILE).read_text(errors="replace")
    engine = [line.split('"')[1] for line in log.splitlines() if "moepipe engine:" in line]
    print(f"{args.example} tp={args.tp}, {args.requests} requests x {args.max_tokens} tokens, "
          f"torch threads {args.threads}")
    print(f"{'conc':>4} | {'server tok/s':>12} {'p50 s':>7} {'p99 s':>7} | "
          f"{'transformers tok/s':>18} {'p50 s':>7} {'p99 s':>7} | {'ratio':>5}")
    for r in rows:
        s, t = r["server"], r["transformers"]
        print(f"{r['concurrency']:>4} | {s['tokens_per_s']:12.1f} {s['p50_s']:7.3f} "
              f"{s['p99_s']:7.3f} | {t['tokens_per_s']:18.1f} {t['p50_s']:7.3f} "
              f"{t['p99_s']:7.3f} | {r['speedup']:5.2f}")
    if engine:
        print(f"server {engine[-1]} (all levels)")
    last = rows[-1]
    print(f"target (server >= 1.0x transformers at concurrency {last['concurrency']}): "
          f"{'MET' if last['speedup'] >= 1.0 else 'NOT MET'} ({last['speedup']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def run_url(args) -> None:
    """Measure an existing deployment (streaming, HTTP and gRPC) and print the table."""
    host, port = args.url.rsplit(":", 1)
    grpc_url = args.grpc_url or f"{host}:{int(port) + 1}"
    prompts = prompts_from_corpus(args.requests)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for protocol in ("http", "grpc"):
        bench_url(args.url, grpc_url, prompts[:4], args.max_tokens, 2, protocol)  # warm-up
        for c in levels:
            rows.append(bench_url(args.url, grpc_url, prompts, args.max_tokens, c, protocol))
    base = {r["protocol"]: r["tokens_per_s"] for r in rows if r["concurrency"] == levels[0]}
    print(f"{args.url} (gRPC {grpc_url}): {args.requests} streamed requests x "
          f"{args.max_tokens} tokens per level")
    print(f"{'proto':>5} {'conc':>4} | {'tok/s':>7} {'vs c' + str(levels[0]):>6} | "
          f"{'TTFT p50':>8} {'p99':>7} | {'ITL p50':>7} {'p99':>7} | {'latency p50':>11} ms")
    for r in rows:
        r["tokens_per_s_vs_first_level"] = round(r["tokens_per_s"] / base[r["protocol"]], 2)
        print(f"{r['protocol']:>5} {r['concurrency']:>4} | {r['tokens_per_s']:7.1f} "
              f"{r['tokens_per_s_vs_first_level']:6.2f} | {r['ttft_ms_p50']:8.2f} "
              f"{r['ttft_ms_p99']:7.2f} | {r['itl_ms_p50']:7.2f} {r['itl_ms_p99']:7.2f} | "
              f"{r['latency_ms_p50']:11.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
