"""``soak``: a steady open-loop load held for ``validate.soak.seconds`` while the deployment is
watched; what a day-long qualification run asks of a deployment, in one job.

Every ``sample_s`` the job samples the RSS of the deployment's processes (the local server and
its Python backend stubs, found by their command lines: :mod:`moepipe.deploy.local.processes`;
a remote endpoint has none here, and the memory check says so) and its KV use (``/metrics``:
the cpu target's ``moepipe_kv_slots_used`` / ``moepipe_kv_slots``, else TensorRT-LLM's
``nv_trt_llm_kv_cache_block_metrics`` ``used`` / ``max`` blocks). It reports:

* the error rate: requests rejected, failed, timed out or not sent (the client's in-flight
  limit: a server that falls behind a steady rate) over all; gate ``max_error_rate``;
* latency drift: p50 / p99 of the last ``window_s`` of sends against the first; gate
  ``max_p99_drift`` (optional);
* a leak: the least-squares slope of RSS, and of KV use, after the first window (warm-up),
  times the run's length: the growth the trend predicts over the run, against
  ``max_memory_growth_mib`` and ``max_kv_growth`` x the KV capacity, once twice the slope's
  standard error is taken off (the noise of a short run is no leak). KV use must also come back
  to its level before the load within ``drain_s`` after it (slots held by no request);
* server restarts (a new server process during the run: the supervisor restarted it).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moepipe.deploy.local.processes import deployment_processes
from moepipe.deploy.local.state import read_state
from moepipe.validate.base import JobContext
from moepipe.validate.load import OUTCOMES, LoadResult, run_load
from moepipe.validate.report import JobResult, Skip, check
from moepipe.validate.stats import distribution, timeline
from moepipe.validate.workload import client_check, plan, prompts_for

if TYPE_CHECKING:
    from moepipe.config import SoakSection

MIB = 1 << 20
PLOT_POINTS = 300  # points per series the report keeps (a day of samples thinned)
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", re.M)
# (used, capacity) gauges, in the order they are looked for
KV_GAUGES = ((("moepipe_kv_slots_used", ""), ("moepipe_kv_slots", "")),
             (("nv_trt_llm_kv_cache_block_metrics", 'kv_cache_block_type="used"'),
              ("nv_trt_llm_kv_cache_block_metrics", 'kv_cache_block_type="max"')))


@dataclass
class Probe:
    """One sample of the deployment; ``t`` in seconds since the load started."""

    t: float
    rss_mib: float | None = None
    servers: tuple[int, ...] = ()
    kv_used: float | None = None
    kv_total: float | None = None


def deployment_rss(state_dir: Path) -> tuple[float | None, tuple[int, ...]]:
    """Summed RSS (MiB) of the server, its stubs and worker ranks of the local deployment kept
    in ``state_dir``, and the server pids."""
    procs = [p for p in deployment_processes(state_dir) if p.kind in ("server", "stub", "rank")]
    total = 0
    for p in procs:
        try:
            status = open(f"/proc/{p.pid}/status").read()
        except OSError:  # gone since it was listed
            continue
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        total += int(m.group(1)) * 1024 if m else 0
    servers = tuple(sorted(p.pid for p in procs if p.kind == "server"))
    return (total / MIB if procs else None), servers


def gauge_sum(text: str, name: str, match: str = "") -> float | None:
    """The sum of a metric's samples (those whose labels contain ``match``); None if none."""
    values = [float(v) for n, labels, v in _SAMPLE.findall(text)
              if n == name and match in (labels or "")]
    return sum(values) if values else None


def kv_use(text: str) -> tuple[float, float] | None:
    """(used, capacity) of the KV cache from a ``/metrics`` page."""
    for (used_name, used_match), (cap_name, cap_match) in KV_GAUGES:
        used, cap = gauge_sum(text, used_name, used_match), gauge_sum(text, cap_name, cap_match)
        if used is not None and cap:
            return used, cap
    return None


def trend(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope (per second) of (t, y) points; None with fewer than three."""
    fit = trend_error(points)
    return None if fit is None else fit[0]


def trend_error(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares slope (per second) of (t, y) points and its standard error; None with
    fewer than three points or no spread in time."""
    if len(points) < 3:
        return None
    t, y = np.array(points, dtype=float).T
    if np.ptp(t) <= 0:
        return None
    slope, icept = np.polyfit(t, y, 1)
    residuals = y - (slope * t + icept)
    se = np.sqrt(residuals @ residuals / (len(t) - 2) / np.sum((t - t.mean()) ** 2))
    return float(slope), float(se)


def thin(points: list, n: int = PLOT_POINTS) -> list:
    """At most ``n`` of the points, evenly spread, first and last kept."""
    if len(points) <= n:
        return points
    idx = np.unique(np.linspace(0, len(points) - 1, n).astype(int))
    return [points[i] for i in idx]


class _Watch:
    """Samples memory and KV use of the endpoint's deployment."""

    def __init__(self, ctx: JobContext):
        ep = ctx.endpoint
        st = read_state(ctx.state_dir) if ctx.state_dir else None
        # the deployment's processes are measured only when the endpoint is its server
        self.state_dir = ctx.state_dir if st is not None and \
            f"{st.host}:{st.http_port}" == ep.http else None
        self.metrics = ep.metrics

    def kv(self) -> tuple[float, float] | None:
        if not self.metrics:
            return None
        base = self.metrics if self.metrics.startswith("http") else f"http://{self.metrics}"
        try:
            with urllib.request.urlopen(base.rstrip("/") + "/metrics", timeout=5) as r:
                return kv_use(r.read().decode(errors="replace"))
        except OSError:  # a scrape missed (the server restarting): a gap, not a failure
            return None

    def probe(self, t: float) -> Probe:
        p = Probe(t)
        if self.state_dir is not None:
            p.rss_mib, p.servers = deployment_rss(self.state_dir)
        kv = self.kv()
        if kv is not None:
            p.kv_used, p.kv_total = kv
        return p


def _run(ctx: JobContext, watch: _Watch, state: dict) -> dict:
    cfg, ep = ctx.cfg, ctx.endpoint
    s = cfg.validation.soak
    idle = watch.kv()
    box: dict = {}
    load = threading.Thread(target=lambda: box.setdefault("res", run_load(plan(
        cfg, ep, prompts_for(cfg), schedule=[(s.seconds, s.rate)],
        max_requests=int(s.rate * s.seconds * 2) + 16, duration_s=s.seconds))), daemon=True)
    start = time.monotonic()
    load.start()
    probes: list[Probe] = []
    while load.is_alive():
        probes.append(watch.probe(time.monotonic() - start))
        load.join(timeout=s.sample_s)
    res: LoadResult = box["res"]
    shift = res.t0 - start  # probe times on the samples' clock
    for p in probes:
        p.t -= shift
    drained = None
    if idle is not None:  # the load has drained: slots must all be free again
        deadline = time.monotonic() + s.drain_s
        while time.monotonic() < deadline:
            now = watch.kv()
            if now is not None and now[0] <= idle[0]:
                drained = round(s.drain_s - (deadline - time.monotonic()), 2)
                break
            time.sleep(min(1.0, s.sample_s))
    state.update(res=res, probes=probes, idle=idle, drained=drained)
    return {"requests": len(res.samples), "wall_s": round(res.wall_s, 2),
            "probes": len(probes)}


def soak(ctx: JobContext) -> JobResult:
    """Steady load for ``validate.soak.seconds``: errors, latency drift, memory and KV trends."""
    job = JobResult("soak")
    watch = _Watch(ctx)
    state: dict = {}
    if job.run("steady_load", lambda: _run(ctx, watch, state)).status != "passed":
        return job
    judge(job, ctx.cfg.validation.soak, state, ctx.endpoint.http,
          local=watch.state_dir is not None)
    client_check(job, [state["res"]])
    return job


def judge(job: JobResult, s: SoakSection, state: dict, where: str, local: bool) -> None:
    """The checks and plot data of a finished run: ``state`` holds the load's result, the
    probes, the idle KV use before it and how long KV use took to return to it after."""
    res, probes = state["res"], state["probes"]
    ok = [x for x in res.samples if x.status == "ok"]
    counts = {k: sum(x.status == k for x in res.samples) for k in OUTCOMES}
    bin_s = max(s.sample_s, s.seconds / PLOT_POINTS)
    job.data.update(seconds=s.seconds, rate=s.rate, window_s=s.window_s, outcomes=counts,
                    timeline=timeline(res.samples, bin_s, s.seconds))

    def errors():
        bad = len(res.samples) - counts["ok"]
        rate = bad / max(len(res.samples), 1)
        job.data["error_rate"] = round(rate, 6)
        first = next((x.error for x in res.samples if x.status != "ok"), "")
        check(rate <= s.max_error_rate, (
            f"error rate {rate:.4%} > {s.max_error_rate:.4%} (validate.soak.max_error_rate): "
            + ", ".join(f"{counts[k]} {k.replace('_', ' ')}" for k in OUTCOMES[1:])
            + (f"; first: {first}" if first else "")))
        return {"error_rate": round(rate, 6), **counts}

    def drift():
        first = [x.latency for x in ok if x.sent < s.window_s]
        last = [x.latency for x in ok if x.sent >= s.seconds - s.window_s]
        check(first and last, f"no successful request in the first or the last {s.window_s:g}s")
        a, b = distribution(first), distribution(last)
        out = {"first_window_ms": a, "last_window_ms": b,
               "p50_ratio": round(b["p50"] / a["p50"], 4),
               "p99_ratio": round(b["p99"] / a["p99"], 4)}
        job.data["latency_drift"] = out
        if s.max_p99_drift is not None:
            check(out["p99_ratio"] <= s.max_p99_drift, (
                f"p99 latency of the last {s.window_s:g}s is {out['p99_ratio']:.2f}x the first's"
                f" ({b['p99']:.1f} ms against {a['p99']:.1f} ms) > {s.max_p99_drift:g} "
                "(validate.soak.max_p99_drift)"))
        return out

    def leak(name, points, bound, unit, setting):
        fit = trend_error([(t, y) for t, y in points if t >= s.window_s])
        check(fit is not None, f"too few {name} samples after the first {s.window_s:g}s "
                               f"(validate.soak.sample_s)")
        slope, se = fit
        # KV use is the requests in flight at the sample: on a short run the slope of such a
        # noisy series passes the bound by chance (a 24 s run read 2 slots of "growth" with
        # nothing held); a leak is growth beyond the bound by more than twice its error
        grows, noise = slope * s.seconds, 2 * se * s.seconds
        out = {"slope_per_hour": round(slope * 3600, 4), "growth_over_run": round(grows, 4),
               "noise_over_run": round(noise, 4), "bound": round(bound, 4), "unit": unit}
        job.data[name] = {**out, "samples": thin([(round(t, 2), round(y, 3))
                                                  for t, y in points])}
        check(grows - noise <= bound, (
            f"{name} grows {slope * 3600:.3g} {unit}/h: {grows:.3g} {unit} (+-{noise:.2f}) "
            f"over the {s.seconds:g}s run > {bound:.3g} ({setting}); a leak"))
        return out

    def memory():
        points = [(p.t, p.rss_mib) for p in probes if p.rss_mib is not None]
        if not points:
            raise Skip(f"{where} is not this workdir's local deployment: its processes "
                       "cannot be measured from here")
        return leak("memory", points, s.max_memory_growth_mib, "MiB",
                    "validate.soak.max_memory_growth_mib")

    def kv():
        points = [(p.t, p.kv_used) for p in probes if p.kv_used is not None]
        total = max((p.kv_total or 0 for p in probes), default=0)
        if not points or not total:
            raise Skip("the endpoint exports no KV-cache gauge (moepipe_kv_slots_used / "
                       "moepipe_kv_slots or nv_trt_llm_kv_cache_block_metrics)")
        job.data["kv_total"] = total
        out = leak("kv_use", points, s.max_kv_growth * total, "slots or blocks",
                   "validate.soak.max_kv_growth x the KV capacity")
        idle = state["idle"]
        if idle is not None:
            check(state["drained"] is not None, (
                f"KV use did not return to its idle level ({idle[0]:g}) within {s.drain_s:g}s "
                "after the load (validate.soak.drain_s): slots held by no request"))
        return {**out, "idle": None if idle is None else idle[0],
                "drained_after_s": state["drained"]}

    def restarts():
        seen = sorted({pid for p in probes for pid in p.servers})
        check(len(seen) <= 1, f"the server was restarted during the run (server pids {seen})")
        return {"server_pids": seen}

    job.run("error_rate", errors)
    job.run("latency_drift", drift)
    job.run("memory_trend", memory)
    job.run("kv_trend", kv)
    if local:
        job.run("no_restarts", restarts)
