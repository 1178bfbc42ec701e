"""Preprocessing queue stalls under near-simultaneous streamed requests, by queue delay.

For each ``--variant`` (``INSTANCES:DELAY_US``) the tiny example is built and deployed on the cpu
target (tp=1, loopback, free ports), then ``--pairs`` pairs of streamed requests are sent through
the ensemble's HTTP ``generate_stream``, the two of a pair 0-6 ms apart, and the server's own
``nv_inference_queue_duration_us`` of the pre- and postprocessing models is read before and after. A
Triton 2.51 dynamic batcher with ``max_queue_delay_microseconds: 0`` sometimes leaves a request
that arrived while the instance was busy waiting out its 500 ms idle wait; this shows it.

    python benchmarks/queue_stall_bench.py [--variant 1:0 --variant 1:100] [--pairs 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml


def metric(url: str, name: str, model: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model="{model}"' in line)


def run_variant(root: Path, n: int, instances: int, delay_us: int, pairs: int) -> dict:
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.config import load_config
    from moepipe.deploy.local import lifecycle

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "e2e"))
    from helpers import free_ports

    workdir = root / f"{n}-i{instances}-d{delay_us}"
    workdir.mkdir(parents=True)
    http, grpc, metrics = free_ports(3)
    data = {"model": {"example": "tiny-mixtral"}, "target": "cpu", "workdir": str(workdir),
            "parallel": {"tp": 1, "moe_ep": 1},
            "build": {"max_batch_size": 16, "max_input_len": 256, "max_seq_len": 512},
            "deploy": {"http_port": http, "grpc_port": grpc, "metrics_port": metrics,
                       "instance_count": instances, "max_queue_delay_microseconds": delay_us}}
    (workdir / "moepipe.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config(workdir / "moepipe.yaml")
    run_build(workdir / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    murl = f"http://127.0.0.1:{metrics}/metrics"

    def stream(i: int, delay_s: float) -> None:
        time.sleep(delay_s)
        body = json.dumps({"text_input": f"Hello number {i}", "max_tokens": 64,
                           "stream": True}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{http}/v2/models/ensemble/generate_stream", body)
        urllib.request.urlopen(req, timeout=60).read()

    try:
        for i in range(3):
            stream(i, 0.0)
        post0 = metric(murl, "nv_inference_queue_duration_us", "postprocessing")
        q0 = metric(murl, "nv_inference_queue_duration_us", "preprocessing")
        c0 = metric(murl, "nv_inference_count", "preprocessing")
        walls = []
        for k in range(pairs):
            threads = [threading.Thread(target=stream, args=(2 * k + j, j * 0.002 * (k % 4)))
                       for j in range(2)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            walls.append(time.perf_counter() - t0)
            time.sleep(0.2)
        post1 = metric(murl, "nv_inference_queue_duration_us", "postprocessing")
        q1 = metric(murl, "nv_inference_queue_duration_us", "preprocessing")
        c1 = metric(murl, "nv_inference_count", "preprocessing")
    finally:
        lifecycle.stop(state_dir(cfg), grace=20)
    walls.sort()
    return {"instances": instances, "delay_us": delay_us, "requests": int(c1 - c0),
            "preprocessing_queue_ms": round((q1 - q0) / 1e3, 1),
            "postprocessing_queue_ms": round((post1 - post0) / 1e3, 1),
            "pair_wall_p50_ms": round(walls[len(walls) // 2] * 1e3),
            "pair_wall_max_ms": round(walls[-1] * 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=None,
                    help="INSTANCES:DELAY_US (repeatable; default 1:0 and 1:100)")
    ap.add_argument("--pairs", type=int, default=100)
    args = ap.parse_args()
    variants = args.variant or ["1:0", "1:100"]
    with tempfile.TemporaryDirectory(prefix="moepipe-qstall-") as tmp:
        for n, v in enumerate(variants):
            instances, delay = (int(x) for x in v.split(":"))
            print(json.dumps(run_variant(Path(tmp), n, instances, delay, args.pairs)),
                  flush=True)


if __name__ == "__main__":
    main()
