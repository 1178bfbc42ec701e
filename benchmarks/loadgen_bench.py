"""moepipe's load driver against NVIDIA AIPerf on the same endpoint, load and prompts.

    python benchmarks/loadgen_bench.py [--aiperf /path/to/venv/bin/aiperf] [--rates 2,4]
                                       [--concurrency 1] [--requests 72] [--max-tokens 64]
                                       [--repeat 3] [--json out.json]

Deploys tiny-mixtral (tp=1) on the cpu target. For each load point, AIPerf (over HTTP
``/generate_stream``, its template endpoint) and moepipe's driver (over the same endpoint,
server-sent events) run AT THE SAME TIME against that server, each with the load shown and the
same prompts and max_tokens, so both see the same server at the same moment: a difference
between their figures is a difference in measuring, not a server that was faster during one
client's turn (measured: run one after the other, the same client's p50 moved 10-25% between
runs on the shared 2-core machine). With two clients at the same rate each request overlaps
the other client's requests alike (with three, fixed arrival phases gave one client requests
that ran alone: 125 vs 140 ms). Then, for the reference column, the driver over gRPC (what
the validation jobs use) runs with the driver over HTTP on the same load, half an interval
apart, for as long. Load points, per client: open loop at a fixed request rate (``--rates``,
evenly spaced arrivals) and closed loop (``--concurrency``). The driver runs in a worker
process (``python -m moepipe.validate.load``) until AIPerf ends; only its requests sent
within AIPerf's profiling window count.

Compared (what both clients measure the same way): request rate, request latency p50/p90/p99,
time to first token p50/p99. Not compared: token throughput and inter-token latency (over the
template endpoint AIPerf counts tokens by re-tokenizing the streamed text, which differs from
the server's counts on a random-weight model). Target (the issue's): request rate and request
latency percentiles within 10% of AIPerf's; TTFT is held to the same 10% in a verdict of its
own, printed for two definitions: from each client's own start, and from the same instant for
both clients, the request written to the socket (see SAME_INSTANT: each client's own start lies
before its connect, and AIPerf's takes longer to connect and write on a busy machine), with each
client's time to connect and write ("write after"). The p99s are also shown pooled over every
repeat's requests (see POOLED).

A client that saturates a core (or takes CPU from the server on a small machine) shows up as a
slow server, so each point also reports every client's CPU (the driver's own getrusage per
worker; AIPerf's whole process tree, sampled from /proc during its profiling window), the
server's CPU (the tritonserver process group: server and backend stubs) per request, the cores
everything else on the machine used meanwhile, and the load average. AIPerf runs with the
fewest processes it allows (one worker, one record processor, no server metrics or GPU
telemetry collection) and, like the driver, a new connection per request; its closed loop is
``--concurrency`` capped by ``--request-rate 1000`` (a bare ``--concurrency`` spins 0.7 of a
core in its timing manager).

AIPerf is not a moepipe dependency (it brings its own stack, numpy 2): install it in its own
virtualenv (``python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install
'aiperf==0.13.*'``) and pass ``--aiperf /tmp/aiperf-venv/bin/aiperf``. Leave HF_HUB_OFFLINE
unset: AIPerf then reads the deployment's tokenizer directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
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
# TTFT from the same instant for both clients: the request's last byte handed to the socket
# (connected, written). The driver's clock starts before it connects (Sample.sent), AIPerf's
# also (aiperf/transports/aiohttp_client.py AioHttpClient._request: start_perf_ns, then
# session.request connects), but the two spend different times connecting and writing;
# per request from AIPerf's profile_export.jsonl: time_to_first_token - http_req_sending
# (http_req_sending runs from aiohttp's on_request_start, before the connect, to the request's
# chunk; aiperf/transports/aiohttp_trace.py). Kept apart from FIGURES: a TTFT verdict is
# printed for each TTFT definition.
SAME_INSTANT = [("TTFT after write p50 ms", "ttft_after_write_ms.p50", ("ttft_after_write", "p50")),
                ("TTFT after write p99 ms", "ttft_after_write_ms.p99", ("ttft_after_write", "p99")),
                # not compared: each client's own time to connect and write (its overhead)
                ("write after p50 ms", "write_after_ms.p50", ("write_after", "p50")),
                ("write after p99 ms", "write_after_ms.p99", ("write_after", "p99"))]
COMPARED_SAME_INSTANT = {"TTFT after write p50 ms", "TTFT after write p99 ms"}
# p99 over every repeat's requests together (3 x 72 per client by default; a p99 of one
# repeat's 72 is its 2nd-largest value): both clients ran together in every repeat, so both
# pools mix the same server states. Shown next to the medians, not in the verdicts.
POOLED = ["latency", "ttft", "ttft_after_write"]
TICK = os.sysconf("SC_CLK_TCK")


def group_cpu(*pgids: int) -> dict[int, dict[int, tuple[str, float]]]:
    """Per process group: pid -> (name, CPU seconds user + system) of its live processes
    (one pass over /proc)."""
    out: dict[int, dict[int, tuple[str, float]]] = {g: {} for g in pgids}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        group = out.get(int(fields[2]))  # fields: state ppid pgrp ... utime(11) stime(12)
        if group is not None:
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            group[int(d.name)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def machine_cpu() -> float:
    """CPU seconds the whole machine was busy (all cores; /proc/stat minus idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / TICK


def snapshot(server_pgid: int, client_pgid: int) -> dict:
    """Wall-clock time and CPU seconds so far of the server, a client and the machine."""
    groups = group_cpu(server_pgid, client_pgid)
    return {"t": time.time(), "server": groups[server_pgid], "client": groups[client_pgid],
            "machine": machine_cpu()}


def cpu_between(a: dict, b: dict, who: str) -> float:
    """CPU seconds of the server's or the client's processes between two snapshots (a
    process that started in between counts from 0)."""
    return sum(cpu - a[who].get(pid, ("", 0.0))[1] for pid, (_, cpu) in b[who].items())


class Sampler:
    """Snapshots every ``every`` seconds in a thread, so the CPU spent between two instants
    known only afterwards (AIPerf's profiling window) can be read."""

    def __init__(self, server_pgid: int, client_pgid: int, every: float = 0.2):
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


def aiperf_cmd(aiperf: str, http: str, tokenizer: Path, data: Path, template: Path,
               max_tokens: int, point: tuple[str, float], arrival: str, requests: int,
               out: Path, cap: float = 1000.0, extra: tuple[str, ...] = ()) -> list[str]:
    kind, value = point
    # At a bare --concurrency AIPerf's timing manager spins (a 0-interval "concurrency burst"
    # that only yields while no slot is free: aiperf/timing/strategies/request_rate.py), 0.7
    # of a core here; capped by a 1000/s rate it checks for a free slot once a millisecond.
    load = (["--concurrency", str(int(value)), "--warmup-request-count", str(int(value)),
             "--request-rate", f"{cap:g}", "--arrival-pattern", "constant"]
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
            "--artifact-dir", str(out), *extra]


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


def aiperf_record_figures(folder: Path) -> dict:
    """From AIPerf's profiled per-request records: TTFT after the request was written and the
    time to connect and write it (see SAME_INSTANT), as AIPerf-style {stat: ms} entries."""
    from moepipe.validate.stats import distribution

    after, write, latency, ttft = [], [], [], []
    for line in (folder / "profile_export.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("metadata", {}).get("benchmark_phase", "profiling") != "profiling":
            continue
        m = {k: v.get("value") for k, v in record.get("metrics", {}).items()}
        if m.get("time_to_first_token") is not None and m.get("http_req_sending") is not None:
            after.append(m["time_to_first_token"] - m["http_req_sending"])
            write.append(m["http_req_sending"])
        if m.get("time_to_first_token") is not None and m.get("request_latency") is not None:
            latency.append(m["request_latency"])
            ttft.append(m["time_to_first_token"])
    return {"ttft_after_write": distribution(after, scale=1.0),
            "write_after": distribution(write, scale=1.0),
            "per_request": {"latency": latency, "ttft": ttft, "ttft_after_write": after}}


def start_driver(url: str, protocol: str, prompts: list[str], max_tokens: int,
                 point: tuple[str, float], phase: float = 0.0) -> dict:
    """A driver worker process loading the server until it is sent SIGTERM. Open loop:
    evenly spaced arrivals, ``phase`` of an interval late (two workers at the same rate and
    phase would send in lockstep, and two requests arriving within a few ms of each other
    are what triggers the server's ~0.3-0.5 s stall described in the README)."""
    from moepipe.validate.load import LoadPlan, Prompt

    ps = [Prompt("short", p, max_tokens) for p in prompts]
    kind, value = point
    load = ({"concurrency": int(value)} if kind == "concurrency" else
            {"schedule": [(phase / value, 0.0), (900.0, value)], "arrival": "constant"})
    plan = LoadPlan(url, ps, max_requests=1_000_000, duration_s=900, timeout_s=60,
                    protocol=protocol, **load)
    t0 = time.monotonic() + 2.0  # the worker's time 0, after its start-up
    t0_wall = time.time() + (t0 - time.monotonic())
    proc = subprocess.Popen([sys.executable, "-m", "moepipe.validate.load"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({"plan": asdict(plan), "t0": t0}) + "\n")
    proc.stdin.flush()
    return {"proc": proc, "t0_wall": t0_wall}


def finish_driver(run: dict) -> dict:
    """Stop a driver worker (in-flight requests drain) and read what it measured."""
    proc = run["proc"]
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit("a driver worker did not stop within 120 s") from None
    if proc.returncode != 0:
        raise SystemExit(f"a driver worker failed (exit {proc.returncode})")
    return {**run, **json.loads(out)}


def driver_figures(run: dict, window: tuple[float, float]) -> dict:
    """The driver's figures over its requests sent within AIPerf's profiling window."""
    from moepipe.validate.load import LoadResult, Sample
    from moepipe.validate.stats import distribution, summarize

    start, end = (t - run["t0_wall"] for t in window)
    samples = [Sample(**s) for s in run["samples"] if start <= s["sent"] <= end]
    out = summarize(LoadResult(samples, end - start), samples, window=(start, end))
    ok = [s for s in samples if s.status == "ok" and s.wrote is not None]
    out["ttft_after_write_ms"] = distribution(s.first - s.wrote for s in ok if s.first)
    out["write_after_ms"] = distribution(s.wrote - s.sent for s in ok)
    done = [s for s in samples if s.status == "ok" and s.first is not None]
    out["per_request"] = {"latency": [1000 * (s.done - s.sent) for s in done],
                          "ttft": [1000 * (s.first - s.sent) for s in done],
                          "ttft_after_write": [1000 * (s.first - s.wrote) for s in ok if s.first]}
    out["client_cores"] = run["cpu"] / run["wall"]
    out["tokens_per_request"] = out["output_tokens_per_s"] / max(out["requests_per_s"], 1e-9)
    return out


def run_point(aiperf: str, http: int, grpc: int, tokenizer: Path, prompts: list[str],
              max_tokens: int, point: tuple[str, float], requests: int, work: Path,
              server_pgid: int, tag: str, cap: float = 1000.0,
              extra: tuple[str, ...] = ()) -> dict:
    """AIPerf and the driver (HTTP) together on one load point, then the driver over gRPC
    and over HTTP together on the same load for as long (the gRPC reference column)."""
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    template = work / "template.json"  # a file: AIPerf splits inline values at commas
    template.write_text(TEMPLATE)
    out = work / f"aiperf-{point[0]}-{point[1]:g}-{tag}"
    cmd = aiperf_cmd(aiperf, f"127.0.0.1:{http}", tokenizer, data, template, max_tokens,
                     point, "constant", requests, out, cap, extra)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # its own group: its whole tree
    driver = start_driver(f"127.0.0.1:{http}", "http", prompts, max_tokens, point)
    try:
        with Sampler(server_pgid, proc.pid) as sampler:
            try:
                log, _ = proc.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise SystemExit("AIPerf did not finish within 900 s") from None
    finally:
        run = finish_driver(driver)
    save_samples(work / f"driver-http-{point[0]}-{point[1]:g}-{tag}.json", run)
    if proc.returncode != 0:
        tail = "\n".join(log.splitlines()[-25:])
        raise SystemExit(f"AIPerf failed (exit {proc.returncode}):\n{tail}")
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise SystemExit(f"AIPerf wrote no profile_export_aiperf.json under {out}")
    theirs = json.loads(found[-1].read_text())
    theirs.update(aiperf_record_figures(found[-1].parent))
    window = profiling_window(found[-1].parent)
    a, b = sampler.at(window[0]), sampler.at(window[1])
    seconds = b["t"] - a["t"]
    theirs["client_cores"] = cpu_between(a, b, "client") / seconds
    by_process: dict[str, float] = {}
    for pid, (name, cpu) in b["client"].items():
        by_process[name] = by_process.get(name, 0.0) + cpu - a["client"].get(pid, ("", 0))[1]
    ours = driver_figures(run, window)
    server = cpu_between(a, b, "server")
    clients = theirs["client_cores"] + ours["client_cores"]
    shared = {"server_cores": server / seconds,
              "server_ms_per_request": 1000 * server / (requests + ours["ok"]),
              "other_cores": max(0.0, (b["machine"] - a["machine"]) / seconds - clients
                                 - server / seconds),
              "aiperf_cores_by_process": {k: v / seconds for k, v in by_process.items()},
              "window_s": seconds, "gap_ms": arrival_gap(found[-1].parent, run, window)}
    # the reference: gRPC next to HTTP, half an interval apart, for as long as AIPerf measured
    pair = {"grpc": start_driver(f"127.0.0.1:{grpc}", "grpc", prompts, max_tokens, point),
            "http": start_driver(f"127.0.0.1:{http}", "http", prompts, max_tokens, point,
                                 phase=0.5)}
    time.sleep(2.0 + 1.0 + seconds)  # start-up, one second to settle, the window
    runs = {k: finish_driver(d) for k, d in pair.items()}
    save_samples(work / f"driver-grpc-{point[0]}-{point[1]:g}-{tag}.json", runs["grpc"])
    settled = runs["grpc"]["t0_wall"] + 1.0
    reference = driver_figures(runs["grpc"], (settled, settled + seconds))
    return {"http": ours, "grpc": reference, "aiperf": theirs, "shared": shared}


def save_samples(path: Path, run: dict) -> None:
    """The driver's per-request records, next to AIPerf's profile_export.jsonl."""
    path.write_text(json.dumps({"t0_wall": run["t0_wall"], "samples": run["samples"]}))


def arrival_gap(folder: Path, run: dict, window: tuple[float, float]) -> float:
    """Median time (ms) from each of AIPerf's requests to the driver's nearest one: a few ms
    means the two clients sent together (the server's stall, see the README)."""
    import numpy as np

    starts = [json.loads(line)["metadata"] for line in
              (folder / "profile_export.jsonl").read_text().splitlines()]
    ours = np.sort([run["t0_wall"] + s["sent"] for s in run["samples"]
                    if window[0] - 5 <= run["t0_wall"] + s["sent"] <= window[1] + 5])
    gaps = []
    for m in starts:
        if m.get("benchmark_phase") != "profiling" or not len(ours):
            continue
        t = m["request_start_ns"] / 1e9
        i = int(np.searchsorted(ours, t))
        gaps.append(min(abs(t - ours[j]) for j in (i - 1, i) if 0 <= j < len(ours)))
    return 1000 * float(np.median(gaps)) if gaps else float("nan")


def aiperf_figure(export: dict, key: tuple[str, str]) -> float | None:
    metric = export.get(key[0]) or export.get("records", {}).get(key[0])
    if not isinstance(metric, dict):
        return None
    value = metric.get(key[1])
    return None if value is None else float(value)


def figures(kind: str, run: dict) -> dict[str, float | None]:
    """The compared figures and the client CPU of one client's run."""
    from moepipe.validate.stats import figure

    out = {name: (aiperf_figure(run, key) if kind == "aiperf" else figure(run, path))
           for name, path, key in FIGURES + SAME_INSTANT}
    out["client CPU cores"] = run["client_cores"]
    out["tokens/request (server)"] = run.get("tokens_per_request")  # not AIPerf's re-count
    rate = out["requests/s"]
    out["client CPU ms/request"] = 1000 * run["client_cores"] / rate if rate else None
    return out


def compare(point: tuple[str, float], runs: list[dict]) -> list[dict]:
    """Per figure: each client's median over the repeats, the median (and range) of the
    repeats' moepipe/AIPerf ratios, and how much the driver's own figure moved between
    repeats (the noise floor of a ratio)."""
    label = f"{point[0]} {point[1]:g}"
    per = {k: [figures(k, r[k]) for r in runs] for k in ("http", "aiperf", "grpc")}
    rows = []
    for name in per["http"][0]:
        ours = [f[name] for f in per["http"]]
        theirs = [f[name] for f in per["aiperf"]]
        compared = name in {f[0] for f in FIGURES} | COMPARED_SAME_INSTANT
        ratios = [a / b for a, b in zip(ours, theirs, strict=True) if a and b] if compared \
            else []
        spread = (max(ours) / min(ours) - 1) if all(ours) and len(ours) > 1 else None
        rows.append({"point": label, "figure": name, "moepipe": median(ours),
                     "aiperf": median(theirs), "ratio": median(ratios) if ratios else None,
                     "ratio_range": [min(ratios), max(ratios)] if ratios else None,
                     "moepipe_spread": spread,
                     "moepipe_grpc": median([f[name] for f in per["grpc"]]),
                     "repeats": {"moepipe": ours, "aiperf": theirs}})
    import numpy as np

    for what in POOLED:
        pooled = {k: [v for r in runs for v in r[k].get("per_request", {}).get(what, [])]
                  for k in ("http", "aiperf", "grpc")}
        p99 = {k: float(np.percentile(v, 99)) if v else None for k, v in pooled.items()}
        ratio = p99["http"] / p99["aiperf"] if p99["http"] and p99["aiperf"] else None
        name = {"latency": "latency", "ttft": "TTFT", "ttft_after_write": "TTFT after write"}
        rows.append({"point": label, "figure": f"{name[what]} p99 pooled",
                     "moepipe": p99["http"], "aiperf": p99["aiperf"], "ratio": ratio,
                     "ratio_range": None, "moepipe_spread": None, "moepipe_grpc": p99["grpc"],
                     "pooled": True,
                     "requests": {"moepipe": len(pooled["http"]),
                                  "aiperf": len(pooled["aiperf"])}})
    return rows


def median(values: list) -> float | None:
    """The median of the values that are there (None: a figure a run did not produce)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", default=str(Path(sys.executable).with_name("aiperf")))
    ap.add_argument("--example", default="tiny-mixtral")
    ap.add_argument("--requests", type=int, default=72,
                    help="AIPerf's requests per point (rounded up to a multiple of 24 prompts)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rates", default="2,4", help="open-loop request rates per client")
    ap.add_argument("--concurrency", default="1", help="closed-loop concurrency per client")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each point")
    ap.add_argument("--closed-loop-cap", type=float, default=1000.0,
                    help="AIPerf's --request-rate in the closed loop (how often it looks for a "
                         "free slot)")
    ap.add_argument("--aiperf-option", action="append", default=[],
                    help="one more AIPerf argument (repeat the option for each word)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not Path(args.aiperf).exists():
        ap.error(f"no AIPerf at {args.aiperf} (hint: --aiperf /path/to/venv/bin/aiperf, see "
                 "this script's docstring)")  # exit 2

    import yaml

    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.config import load_config
    from moepipe.deploy.local import lifecycle
    from moepipe.deploy.local.lifecycle import status
    from moepipe.validate.load import LoadPlan, Prompt, run_load
    from moepipe.validate.workload import short_prompts

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
    results: dict[tuple[str, float], list[dict]] = {p: [] for p in points}
    load = [os.getloadavg()[0]]
    try:
        for url, protocol in ((f"127.0.0.1:{http}", "http"), (f"127.0.0.1:{grpc}", "grpc")):
            run_load(LoadPlan(url, [Prompt("short", p, args.max_tokens) for p in prompts],
                              concurrency=2, max_requests=4, protocol=protocol))  # warm-up
        for i in range(args.repeat):
            for point in points:
                results[point].append(run_point(
                    args.aiperf, http, grpc, cfg.deploy_dir / "tokenizer", prompts,
                    args.max_tokens, point, args.requests, work, pgid, str(i),
                    args.closed_loop_cap, tuple(args.aiperf_option)))
                load.append(os.getloadavg()[0])
    finally:
        lifecycle.stop(state_dir(cfg))
    report(args, points, results, load)
    print(f"per-request records (AIPerf's and the driver's): {work}")


def report(args, points: list, results: dict, load: list[float]) -> None:
    print(f"{args.example} tp=1, {args.max_tokens} tokens per request; per point AIPerf (HTTP)"
          f" and moepipe's driver (HTTP) run together, each with the load shown "
          f"({args.requests} AIPerf requests), then the driver over gRPC next to the driver over"
          f" HTTP; {args.repeat} repeats (medians); 1-minute load average "
          f"{min(load):.2f}-{max(load):.2f}")
    print("ratio: median [range] of the repeats' moepipe/AIPerf; spread: max/min - 1 of the "
          "driver's own repeats")
    print(f"{'point (per client)':<18} | {'figure':<22} | {'moepipe':>8} | {'aiperf':>8} | "
          f"{'ratio [range]':<19} | spread | {'gRPC':>8}")
    worst, rows = {"target": 0.0, "own": 0.0, "same": 0.0}, []
    own_ttft = {"TTFT p50 ms", "TTFT p99 ms"}
    target = {name for name, _, _ in FIGURES} - own_ttft  # request rate and latency
    fmt = lambda v: "-" if v is None else f"{v:8.2f}"  # noqa: E731
    for point in points:
        point_rows = compare(point, results[point])
        rows += point_rows
        for r in point_rows:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}" if r.get("pooled") \
                else f"{r['ratio']:.3f} [{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}]"
            spread = "-" if r["moepipe_spread"] is None else f"{r['moepipe_spread']:.0%}"
            print(f"{r['point']:<18} | {r['figure']:<22} | {fmt(r['moepipe'])} | "
                  f"{fmt(r['aiperf'])} | {ratio:<19} | {spread:>6} | {fmt(r['moepipe_grpc'])}")
            if r["ratio"] is not None and not r.get("pooled"):
                for verdict, figures in (("target", target), ("own", own_ttft),
                                         ("same", COMPARED_SAME_INSTANT)):
                    if r["figure"] in figures:
                        worst[verdict] = max(worst[verdict], abs(r["ratio"] - 1))
        for shared in (run["shared"] for run in results[point]):
            busiest = sorted(shared["aiperf_cores_by_process"].items(), key=lambda kv: -kv[1])
            print(f"    server {shared['server_cores']:.2f} cores, "
                  f"{shared['server_ms_per_request']:.0f} ms CPU/request; everything else "
                  f"{shared['other_cores']:.2f} cores; AIPerf request to nearest driver "
                  f"request: median {shared['gap_ms']:.1f} ms; AIPerf by process (cores): "
                  + ", ".join(f"{n} {c:.2f}" for n, c in busiest[:3]))
    for verdict, what in (("target", "target: request rate and latency p50/p90/p99"),
                          ("own", "TTFT p50/p99 from each client's own start"),
                          ("same", "TTFT p50/p99 after the request was written")):
        print(f"{what} within 10% of AIPerf's at every point: "
              f"{'MET' if worst[verdict] <= 0.10 else 'NOT MET'} "
              f"(largest difference {worst[verdict]:.1%})")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "loadavg": load, "runs": [
            {"point": list(p), "repeat": i, "shared": r["shared"]}
            for p in points for i, r in enumerate(results[p])]}, indent=2))


if __name__ == "__main__":
    main()
