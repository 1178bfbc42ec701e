"""Figures from load samples: percentiles, per-point summaries, SLO checks, goodput, timelines."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from moepipe.validate.load import OUTCOMES, LoadResult, Sample

QUANTILES = {"p50": 50, "p90": 90, "p99": 99, "p99_9": 99.9}
# SLO key -> (figure in a summary, "max" or "min"): the job fails naming the figure and limit.
SLO_FIGURES = {
    "ttft_p99_ms": ("ttft_ms.p99", "max"),
    "latency_p99_ms": ("latency_ms.p99", "max"),
    "itl_p99_ms": ("itl_ms.p99", "max"),
    "min_output_tokens_per_s": ("output_tokens_per_s", "min"),
    "max_error_rate": ("error_rate", "max"),
}


def distribution(values: Iterable[float | None], scale: float = 1000.0) -> dict:
    """p50/p90/p99/p99.9, mean and max of the values that exist, scaled (s -> ms)."""
    arr = np.array([v for v in values if v is not None], dtype=float) * scale
    if arr.size == 0:
        return {"count": 0}
    out = {k: round(float(np.percentile(arr, q)), 3) for k, q in QUANTILES.items()}
    out.update(count=int(arr.size), mean=round(float(arr.mean()), 3),
               max=round(float(arr.max()), 3))
    return out


def summarize(result: LoadResult, samples: list[Sample] | None = None,
              window: tuple[float, float] | None = None) -> dict:
    """One load point: latency, TTFT and ITL distributions, rates, outcomes, client CPU."""
    samples = result.samples if samples is None else samples
    if window is None:
        ends = [s.done for s in samples if s.done is not None]
        window = (min((s.sent for s in samples), default=0.0), max(ends, default=0.0))
    seconds = max(window[1] - window[0], 1e-9)
    ok = [s for s in samples if s.status == "ok"]
    counts = {k: sum(s.status == k for s in samples) for k in OUTCOMES}
    sent = len(samples) - counts["not_sent"]
    errors = counts["rejected"] + counts["failed"] + counts["timeout"]
    return {
        "requests": len(samples), "seconds": round(seconds, 3), **counts,
        "requests_per_s": round(len(ok) / seconds, 3),
        "output_tokens_per_s": round(sum(s.tokens for s in ok) / seconds, 2),
        "input_tokens_per_s": round(sum(s.input_tokens for s in ok) / seconds, 2),
        "error_rate": round(errors / sent, 4) if sent else 0.0,
        "latency_ms": distribution(s.latency for s in ok),
        "ttft_ms": distribution(s.ttft for s in ok),
        "itl_ms": distribution(s.itl for s in ok),
        "client_cpu_max": round(result.client_cpu_max, 3),
    }


def figure(summary: dict, path: str) -> float | None:
    """A figure of a summary by dotted path (``latency_ms.p99``); None where not measured."""
    value: object = summary
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, int | float) else None


def slo_violations(summary: dict, slo: dict[str, float | None]) -> list[str]:
    """Each SLO the point misses, as '<figure> <value> > <limit> (slo.<key>)'."""
    out = []
    for key, limit in slo.items():
        if limit is None:
            continue
        path, kind = SLO_FIGURES[key]
        value = figure(summary, path)
        if value is None:
            out.append(f"{path} was not measured (no successful requests; slo.{key} {limit:g})")
        elif (kind == "max" and value > limit) or (kind == "min" and value < limit):
            sign = ">" if kind == "max" else "<"
            out.append(f"{path} {value:g} {sign} {limit:g} (slo.{key})")
    return out


def goodput(samples: list[Sample], slo: dict[str, float | None], seconds: float) -> float:
    """Requests per second that met every per-request SLO (TTFT, latency, ITL)."""
    limits = {"ttft_p99_ms": "ttft", "latency_p99_ms": "latency", "itl_p99_ms": "itl"}
    good = 0
    for s in samples:
        if s.status != "ok":
            continue
        if all((limit := slo.get(k)) is None or (getattr(s, attr) or 0.0) * 1000 <= limit
               for k, attr in limits.items()):
            good += 1
    return round(good / max(seconds, 1e-9), 3)


def timeline(samples: list[Sample], bin_s: float, until: float) -> list[dict]:
    """Per time bin (by send time): p99 latency of the ok requests and every outcome's count."""
    bins = max(1, math.ceil(until / bin_s))
    rows: list[dict] = [{"t": round(i * bin_s, 3), **{k: 0 for k in OUTCOMES}}
                        for i in range(bins)]
    lats: list[list[float]] = [[] for _ in range(bins)]
    for s in samples:
        i = min(int(s.sent // bin_s), bins - 1)
        rows[i][s.status] += 1
        if s.latency is not None:
            lats[i].append(s.latency * 1000)
    for r, lat in zip(rows, lats, strict=True):
        r["p99_ms"] = round(float(np.percentile(lat, 99)), 3) if lat else None
        r["p50_ms"] = round(float(np.percentile(lat, 50)), 3) if lat else None
    return rows


def cdf(values: list[float], points: int = 200) -> list[tuple[float, float]]:
    """(value, fraction <= value), thinned to at most ``points`` points."""
    arr = np.sort(np.array(values, dtype=float))
    if arr.size == 0:
        return []
    idx = np.unique(np.linspace(0, arr.size - 1, min(points, arr.size)).astype(int))
    return [(float(arr[i]), (i + 1) / arr.size) for i in idx]


def histogram(values: list[float], bins: int = 30) -> tuple[list[float], list[int]]:
    """Bin edges and counts of the values."""
    if not values:
        return [], []
    counts, edges = np.histogram(np.array(values, dtype=float), bins=bins)
    return [float(e) for e in edges], [int(c) for c in counts]
