"""A real soak of the tiny example on the cpu target, and perf priced at a given US$/h.

    python benchmarks/soak_run.py [--seconds 300] [--rate 2] [--usd-per-hour 0.10]
        [--ports 18600] [--workdir DIR] [--json FILE]

Builds tiny-mixtral (tp=2, moe_ep=2) in a fresh workdir, deploys it on loopback (``--ports``:
HTTP, then gRPC, metrics and rank 0's port for the other rank on the next three), runs
``moepipe validate --job perf`` with ``validate.cost.usd_per_hour`` and then ``--job soak`` for
``--seconds`` at ``--rate`` requests/s, stops the server and prints the figures the README
quotes (every gate's result, error rate, p50/p99 of the first and last windows, RSS and KV
trends, the cost per million tokens at each perf point). The reports stay in
``<workdir>/reports``. Run it under the machine's heavy-work lock: it holds a tritonserver and
a steady load for the whole run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--window", type=float, default=60)
    ap.add_argument("--usd-per-hour", type=float, default=0.10)
    ap.add_argument("--ports", type=int, default=18600)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import run_validate
    from moepipe.config import load_config
    from moepipe.deploy.local import lifecycle

    work = args.workdir or Path(tempfile.mkdtemp(prefix="moepipe-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {"example": "tiny-mixtral"}, "parallel": {"tp": 2, "moe_ep": 2},
        "workdir": str(work / "work"),
        "deploy": {"http_port": args.ports, "grpc_port": args.ports + 1,
                   "metrics_port": args.ports + 2, "rank_port": args.ports + 3},
        "validate": {"load": {"max_tokens": 16},
                     "perf": {"concurrency": [1, 4], "rates": [], "requests": 48,
                              "duration_s": 30},
                     "cost": {"usd_per_hour": args.usd_per_hour},
                     "soak": {"seconds": args.seconds, "rate": args.rate,
                              "window_s": args.window, "sample_s": 5}}}
    path = work / "moepipe.yaml"
    path.write_text(yaml.safe_dump(config))
    cfg = load_config(path)
    run_build(path, echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    out: dict = {"seconds": args.seconds, "rate": args.rate, "usd_per_hour": args.usd_per_hour}
    try:
        started = time.monotonic()
        perf, _ = run_validate(cfg, jobs=["perf"], echo=lambda s: None)
        soak, paths = run_validate(cfg, jobs=["soak"], echo=lambda s: None)
        out["wall_s"] = round(time.monotonic() - started, 1)
    finally:
        lifecycle.stop(state_dir(cfg), grace=40)
    p = perf.jobs[0]
    out["perf"] = [{"label": pt["label"],
                    **{k: pt["summary"][k] for k in ("output_tokens_per_s",
                                                     "input_tokens_per_s")}, **pt["cost"]}
                   for pt in p.data["points"]]
    s = soak.jobs[0]
    d = s.data
    out["soak"] = {
        "passed": s.passed, "cases": {c.name: c.status for c in s.cases},
        "messages": {c.name: c.message for c in s.cases if c.message},
        "outcomes": d["outcomes"], "error_rate": d.get("error_rate"),
        "latency_drift": {k: d["latency_drift"][k] for k in ("p50_ratio", "p99_ratio")}
        if "latency_drift" in d else None,
        "first_window_ms": {k: d["latency_drift"]["first_window_ms"].get(k)
                            for k in ("p50", "p99")} if "latency_drift" in d else None,
        "last_window_ms": {k: d["latency_drift"]["last_window_ms"].get(k)
                           for k in ("p50", "p99")} if "latency_drift" in d else None,
        "memory": {k: v for k, v in d.get("memory", {}).items() if k != "samples"},
        "rss_mib_first_last": [d["memory"]["samples"][0][1], d["memory"]["samples"][-1][1]]
        if d.get("memory") else None,
        "kv_use": {k: v for k, v in d.get("kv_use", {}).items() if k != "samples"},
        "reports": [str(x) for x in paths]}
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if s.passed else 1


if __name__ == "__main__":
    sys.exit(main())
