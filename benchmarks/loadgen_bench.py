"""moepipe's load driver against NVIDIA AIPerf on the same endpoint, load and prompts.

    python benchmarks/loadgen_bench.py [--aiperf /path/to/venv/bin/aiperf] [--rates 2,4]
                                       [--concurrency 1] [--requests 72] [--max-tokens 64]
                                       [--arrival constant|poisson] [--repeat 3] [--json out.json]

Deploys tiny-mixtral (tp=1) on the cpu target, then for each load point runs three clients one
after the other against the same server, with the same prompts and max_tokens: moepipe's
driver over HTTP ``/generate_stream`` (server-sent events), AIPerf over the same endpoint (its
template endpoint), and moepipe's driver over gRPC streaming (what the validation jobs use; a
reference column). Load points: open loop at fixed request rates (``--rates``; evenly spaced
arrivals by default, the same for both clients) and closed loop (``--concurrency``).

Compared (what both clients measure the same way): request rate, request latency p50/p90/p99,
time to first token p50/p99. Not compared: token throughput and inter-token latency (over the
template endpoint AIPerf counts tokens by re-tokenizing the streamed text, which differs from
the server's counts on a random-weight model). Target: every compared figure within 10%.

A client that saturates a core (or takes CPU from the server on a small machine) shows up as a
slow server, so each run also reports the client's CPU (the driver's own getrusage; AIPerf's
whole process tree, sampled from /proc during its profiling window), the server's CPU (the
tritonserver process group: server and backend stubs) per request, the cores everything else
on the machine used meanwhile, and the load average. Each client runs ``--repeat`` times per
point in rotating order; the figures are medians, the ratio the median of the repeats' ratios,
and the driver's own run-to-run spread is shown as the noise floor.
AIPerf runs with the fewest processes it allows (one worker, one record processor, no server
metrics or GPU telemetry collection).

AIPerf is not a moepipe dependency (it brings its own stack, numpy 2): install it in its own
virtualenv (``python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install
'aiperf==0.13.*'``) and pass ``--aiperf /tmp/aiperf-venv/bin/aiperf``. Leave HF_HUB_OFFLINE
unset: AIPerf then reads the deployment's tokenizer directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TEMPLATE = ('{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens|tojson }}, '
            '"stream": {{ stream|lower }}}')
# (label, driver summary path, AIPerf metric and stat)
FIGURES = [("requests/s", "requests_per_s", ("request_throughput", "avg")),
           ("latency p50 ms", "latency_ms.p50", ("request_latency", "p50")),
           ("latency p90 ms", "latency_ms.p90", ("request_latency", "p90")),
           ("latency p99 ms", "latency_ms.p99", ("request_latency", "p99")),
           ("TTFT p50 ms", "ttft_ms.p50", ("time_to_first_token", "p50")),
           ("TTFT p99 ms", "ttft_ms.p99", ("time_to_first_token", "p99"))]
TICK = os.sysconf("SC_CLK_TCK")


def group_cpu(pgid: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds user + system) of the live processes of a process group."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid:  # fields: state ppid pgrp ... utime(11) stime(12)
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            out[int(d.name)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def machine_cpu() -> float:
    """CPU seconds the whole machine was busy (all cores; /proc/stat minus idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / TICK


def snapshot(server_pgid: int, client_pgid: int | None = None) -> dict:
    """Wall-clock time and CPU seconds so far of the server, a client and the machine."""
    return {"t": time.time(), "server": group_cpu(server_pgid), "machine": machine_cpu(),
            "client": group_cpu(client_pgid) if client_pgid else {}}


def cpu_between(a: dict, b: dict, who: str) -> float:
    """CPU seconds of the server's or the client's processes between two snapshots (a
    process that started in between counts from 0)."""
    return sum(cpu - a[who].get(pid, ("", 0.0))[1] for pid, (_, cpu) in b[who].items())


class Sampler:
    """Snapshots every ``every`` seconds in a thread, so the CPU spent between two instants
    known only afterwards (AIPerf's profiling window) can be read. Not used around the
    driver: its CPU is its own process's getrusage, which would count this thread."""

    def __init__(self, server_pgid: int, client_pgid: int, every: float = 0.1):
        self.server_pgid, self.client_pgid, self.every = server_pgid, client_pgid, every
        self.snaps: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.snaps.append(snapshot(self.server_pgid, self.client_pgid))
            self._stop.wait(self.every)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> dict:
        return min(self.snaps, key=lambda snap: abs(snap["t"] - t))


def usage(a: dict, b: dict, client_cpu_s: float | None = None) -> dict:
    """CPU use between two snapshots: client, server, and everything else on the machine."""
    client = cpu_between(a, b, "client") if client_cpu_s is None else client_cpu_s
    server = cpu_between(a, b, "server")
    return {"window_s": b["t"] - a["t"], "client_cpu_s": client, "server_cpu_s": server,
            "other_cpu_s": max(0.0, b["machine"] - a["machine"] - client - server)}


def aiperf_cmd(aiperf: str, http: str, tokenizer: Path, data: Path, template: Path,
               max_tokens: int, point: tuple[str, float], arrival: str, requests: int,
               out: Path) -> list[str]:
    kind, value = point
    load = (["--concurrency", str(int(value)), "--warmup-request-count", str(int(value))]
            if kind == "concurrency" else
            ["--request-rate", f"{value:g}", "--arrival-pattern", arrival,
             "--warmup-request-count", "2"])
    return [aiperf, "profile", "--model", "ensemble", "--url", f"http://{http}",
            "--custom-endpoint", "/v2/models/ensemble/generate_stream",
            "--endpoint-type", "template", "--extra-inputs", f"payload_template:{template}",
            "--extra-inputs", "response_field:text_output", "--streaming",
            "--tokenizer", str(tokenizer), "--input-file", str(data),
            "--custom-dataset-type", "single_turn", "--output-tokens-mean", str(max_tokens),
            "--output-tokens-stddev", "0", *load, "--request-count", str(requests),
            "--random-seed", "0", "--workers-max", "1", "--record-processors", "1",
            "--connection-reuse-strategy", "never",  # the driver's: a connection per request
            "--dataset-sampling-strategy", "sequential",  # every prompt equally often
            "--no-server-metrics", "--no-gpu-telemetry", "--ui-type", "none",
            "--artifact-dir", str(out)]


def run_aiperf(aiperf: str, http: str, tokenizer: Path, prompts: list[str], max_tokens: int,
               point: tuple[str, float], arrival: str, requests: int, work: Path,
               server_pgid: int) -> dict:
    """One AIPerf profile: its profile_export_aiperf.json plus client and server CPU during
    its profiling window (first request sent .. last response)."""
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    template = work / "template.json"  # a file: AIPerf splits inline values at commas
    template.write_text(TEMPLATE)
    out = work / f"aiperf-{point[0]}-{point[1]:g}"
    cmd = aiperf_cmd(aiperf, http, tokenizer, data, template, max_tokens, point, arrival,
                     requests, out)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # its own group: its whole tree
    with Sampler(server_pgid, proc.pid) as sampler:
        try:
            log, _ = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            raise SystemExit("AIPerf did not finish within 900 s") from None
    if proc.returncode != 0:
        tail = "\n".join(log.splitlines()[-25:])
        raise SystemExit(f"AIPerf failed (exit {proc.returncode}):\n{tail}")
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise SystemExit(f"AIPerf wrote no profile_export_aiperf.json under {out}")
    export = json.loads(found[-1].read_text())
    a, b = (sampler.at(t) for t in profiling_window(found[-1].parent))
    export.update(usage(a, b))
    per_process: dict[str, float] = {}
    for pid, (name, cpu) in b["client"].items():
        per_process[name] = per_process.get(name, 0.0) + cpu - a["client"].get(pid, ("", 0))[1]
    export["client_cpu_by_process"] = per_process
    return export


def profiling_window(folder: Path) -> tuple[float, float]:
    """Wall-clock start of the first and end of the last profiled request (AIPerf's
    per-request export), in seconds."""
    starts, ends = [], []
    for line in (folder / "profile_export.jsonl").read_text().splitlines():
        meta = json.loads(line).get("metadata", {})
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue
        starts.append(meta["request_start_ns"] / 1e9)
        ends.append(meta["request_end_ns"] / 1e9)
    if not starts:
        raise SystemExit(f"no profiled request in {folder / 'profile_export.jsonl'}")
    return min(starts), max(ends)


def run_driver(url: str, protocol: str, prompts: list[str], max_tokens: int,
               point: tuple[str, float], arrival: str, requests: int,
               server_pgid: int) -> dict:
    from moepipe.validate.load import LoadPlan, Prompt, run_load
    from moepipe.validate.stats import summarize

    ps = [Prompt("short", p, max_tokens) for p in prompts]
    kind, value = point
    if kind == "concurrency":
        plan = LoadPlan(url, ps, concurrency=int(value), max_requests=requests,
                        duration_s=600, protocol=protocol)
        warm = LoadPlan(url, ps, concurrency=int(value), max_requests=int(value),
                        protocol=protocol)
    else:
        plan = LoadPlan(url, ps, schedule=[(requests / value + 1, value)],
                        max_requests=requests, duration_s=600, protocol=protocol,
                        arrival=arrival)
        warm = LoadPlan(url, ps, schedule=[(2 / value + 1, value)], max_requests=2,
                        protocol=protocol, arrival=arrival)
    run_load(warm)
    before = snapshot(server_pgid)
    res = run_load(plan)
    after = snapshot(server_pgid)
    out = summarize(res)
    out.update(usage(before, after, sum(res.client_cpu_s)))  # the driver's own getrusage
    return out


def aiperf_figure(export: dict, key: tuple[str, str]) -> float | None:
    metric = export.get(key[0]) or export.get("records", {}).get(key[0])
    if not isinstance(metric, dict):
        return None
    value = metric.get(key[1])
    return None if value is None else float(value)


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def figures(kind: str, run: dict, requests: int) -> dict[str, float | None]:
    """The compared figures and the CPU figures of one run of one client."""
    from moepipe.validate.stats import figure

    out = {name: (aiperf_figure(run, key) if kind == "aiperf" else figure(run, path))
           for name, path, key in FIGURES}
    out["client CPU ms/request"] = 1000 * run["client_cpu_s"] / requests
    out["server CPU ms/request"] = 1000 * run["server_cpu_s"] / requests
    out["server CPU cores"] = run["server_cpu_s"] / run["window_s"]
    if kind != "aiperf":  # the server's own counts (AIPerf re-tokenizes the text)
        out["tokens/request"] = run["output_tokens_per_s"] / max(run["requests_per_s"], 1e-9)
    out["other CPU cores"] = run["other_cpu_s"] / run["window_s"]
    return out


def compare(point: tuple[str, float], runs: dict[str, list[dict]]) -> list[dict]:
    """Per figure: each client's median over the repeats, the median (and range) of the
    repeats' moepipe/AIPerf ratios (each repeat ran both clients back to back), and how much
    the driver's own figure moved between repeats (the noise floor of a ratio)."""
    label = f"{point[0]} {point[1]:g}"
    rows = []
    for name in runs["http"][0]:
        ours = [r[name] for r in runs["http"]]
        theirs = [r.get(name) for r in runs["aiperf"]]
        compared = name in {f[0] for f in FIGURES}
        ratios = [a / b for a, b in zip(ours, theirs, strict=True) if a and b] if compared \
            else []
        spread = (max(ours) / min(ours) - 1) if all(ours) and len(ours) > 1 else None
        rows.append({"point": label, "figure": name, "moepipe": median(ours),
                     "aiperf": median(theirs), "ratio": median(ratios) if ratios else None,
                     "ratio_range": [min(ratios), max(ratios)] if ratios else None,
                     "moepipe_spread": spread,
                     "moepipe_grpc": median([r[name] for r in runs["grpc"]]),
                     "repeats": {"moepipe": ours, "aiperf": theirs}})
    return rows


def median(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", default=str(Path(sys.executable).with_name("aiperf")))
    ap.add_argument("--example", default="tiny-mixtral")
    ap.add_argument("--requests", type=int, default=72,
                    help="measured requests per run (rounded up to a multiple of 24 prompts)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rates", default="2,4", help="open-loop request rates (req/s)")
    ap.add_argument("--concurrency", default="1", help="closed-loop concurrencies ('' none)")
    ap.add_argument("--arrival", choices=["constant", "poisson"], default="constant")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each client per point, in rotating order")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not Path(args.aiperf).exists() and not args.aiperf.startswith("aiperf"):
        raise SystemExit(f"error: no AIPerf at {args.aiperf} (hint: --aiperf "
                         "/path/to/venv/bin/aiperf, see this script's docstring)")

    import yaml

    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.config import load_config
    from moepipe.deploy import server
    from moepipe.deploy.lifecycle import status
    from moepipe.validate.loadjobs import short_prompts

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "e2e"))
    from helpers import free_ports

    points = [("concurrency", float(c)) for c in args.concurrency.split(",") if c.strip()]
    points += [("rate", float(r)) for r in args.rates.split(",") if r.strip()]
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
    pgid = int(status(state_dir(cfg))["pid"])  # the server leads its process group
    prompts = short_prompts(cfg, 24)
    if args.requests % len(prompts):  # the same work for every client: each prompt as often
        args.requests += len(prompts) - args.requests % len(prompts)
        print(f"--requests rounded up to {args.requests} (a multiple of {len(prompts)} "
              "prompts)", flush=True)
    rows, load = [], [loadavg()]
    clients = {
        "http": lambda point: run_driver(f"127.0.0.1:{http}", "http", prompts,
                                         args.max_tokens, point, args.arrival, args.requests,
                                         pgid),
        "aiperf": lambda point: run_aiperf(args.aiperf, f"127.0.0.1:{http}",
                                           cfg.deploy_dir / "tokenizer", prompts,
                                           args.max_tokens, point, args.arrival,
                                           args.requests, work, pgid),
        "grpc": lambda point: run_driver(f"127.0.0.1:{grpc}", "grpc", prompts,
                                         args.max_tokens, point, args.arrival, args.requests,
                                         pgid)}
    try:
        for point in points:
            runs: dict[str, list[dict]] = {k: [] for k in clients}
            for i in range(args.repeat):
                # the order rotates, so no client always runs first after another one
                order = list(clients)[i % 3:] + list(clients)[:i % 3]
                for kind in order:
                    run = clients[kind](point)
                    runs[kind].append(figures(kind, run, args.requests))
                    if kind == "aiperf":
                        busiest = sorted(run["client_cpu_by_process"].items(),
                                         key=lambda kv: -kv[1])[:4]
                        print(f"{point[0]} {point[1]:g}: AIPerf CPU ms/request by process: "
                              + ", ".join(f"{n} {1000 * c / args.requests:.1f}"
                                          for n, c in busiest), flush=True)
                load.append(loadavg())
            rows += compare(point, runs)
    finally:
        server.stop(state_dir(cfg))
    report(args, rows, load)


def report(args, rows: list[dict], load: list[float]) -> None:
    arrivals = f", {args.arrival} arrivals" if args.rates else ""
    print(f"{args.example} tp=1, {args.requests} requests x {args.max_tokens} tokens per run, "
          f"streaming{arrivals}, {args.repeat} repeats per client (medians); "
          f"1-minute load average {min(load):.2f}-{max(load):.2f}")
    print("both over HTTP /generate_stream (moepipe's driver over gRPC streaming for reference);"
          " ratio: median [range] of the repeats' moepipe/AIPerf; spread: max/min - 1 of the "
          "driver's own repeats")
    print(f"{'point':<15} | {'figure':<22} | {'moepipe':>8} | {'aiperf':>8} | "
          f"{'ratio [range]':<19} | spread | {'gRPC':>8}")
    worst = 0.0
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:8.2f}"  # noqa: E731
        ratio = "-" if r["ratio"] is None else \
            f"{r['ratio']:.3f} [{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}]"
        spread = "-" if r["moepipe_spread"] is None else f"{r['moepipe_spread']:.0%}"
        print(f"{r['point']:<15} | {r['figure']:<22} | {fmt(r['moepipe'])} | "
              f"{fmt(r['aiperf'])} | {ratio:<19} | {spread:>6} | {fmt(r['moepipe_grpc'])}")
        if r["ratio"] is not None:
            worst = max(worst, abs(r["ratio"] - 1))
    print(f"target (every compared figure within 10% of AIPerf's): "
          f"{'MET' if worst <= 0.10 else 'NOT MET'} (largest difference {worst:.1%})")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "loadavg": load}, indent=2))


if __name__ == "__main__":
    main()
