"""``reports/validate.html``: one self-contained page per validation run.

Everything is inline (CSS, SVG charts, a few lines of script that only measure the page): the
file opens offline, from an e-mail or a CI artifact. It is rendered from the report's JSON
(``validate.json``), so the picture and the numbers cannot disagree.
"""

from __future__ import annotations

import time
from html import escape

from moepipe.validate import svg
from moepipe.validate.heatmap import heatmap

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;
color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
.passed{color:#1a7f37;font-weight:bold}.failed,.error{color:#c62828;font-weight:bold}
.skipped{color:#777}.plots{display:flex;flex-wrap:wrap;gap:12px}
.plot{border:1px solid #eee}.msg{font-family:monospace;font-size:12px;white-space:pre-wrap}
"""
# The page checks itself: every chart has drawn something and has a size. A headless browser
# test reads these attributes (and the console) instead of trusting the markup.
SCRIPT = """
window.addEventListener('load', function () {
  var plots = document.querySelectorAll('svg.plot'), boxes = [];
  for (var i = 0; i < plots.length; i++) {
    var b = plots[i].getBoundingClientRect();
    boxes.push([plots[i].getAttribute('data-plot'), Math.round(b.left + window.scrollX),
                Math.round(b.top + window.scrollY), Math.round(b.width),
                Math.round(b.height), plots[i].querySelectorAll('*').length].join(','));
  }
  document.body.setAttribute('data-plots', boxes.join(';'));
});
"""


def _case_rows(job: dict) -> str:
    rows = []
    for c in job["cases"]:
        rows.append(f'<tr><td>{escape(c["name"])}</td><td class="{c["status"]}">'
                    f'{c["status"]}</td><td>{c["seconds"]:.2f}s</td>'
                    f'<td class="msg">{escape(c.get("message") or "")}</td></tr>')
    return ("<table><tr><th>check</th><th>result</th><th>time</th><th>message</th></tr>"
            + "".join(rows) + "</table>")


def _cost_cells(p: dict) -> str:
    c = p.get("cost")
    if c is None:
        return ""
    fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    return (f"<td>{fmt(c['usd_per_million_output_tokens'])}</td>"
            f"<td>{fmt(c['usd_per_million_tokens'])}</td>")


def _point_table(points: list[dict]) -> str:
    priced = any("cost" in p for p in points)
    head = ("<tr><th>load</th><th>req/s</th><th>out tok/s</th><th>goodput req/s</th>"
            "<th>TTFT p50/p99 ms</th><th>ITL p50/p99 ms</th><th>latency p50/p90/p99/p99.9 ms"
            "</th><th>max ms</th><th>errors</th><th>client CPU</th>"
            + ("<th>US$ / M output tokens</th><th>US$ / M tokens (in + out)</th>" if priced
               else "") + "</tr>")
    rows = []
    for p in points:
        s = p["summary"]
        lat, ttft, itl = s["latency_ms"], s["ttft_ms"], s["itl_ms"]
        g = lambda d, k: f"{d[k]:.1f}" if k in d else "-"  # noqa: E731
        rows.append(
            f"<tr><td>{escape(p['label'])}</td><td>{s['requests_per_s']}</td>"
            f"<td>{s['output_tokens_per_s']}</td><td>{p.get('goodput', '-')}</td>"
            f"<td>{g(ttft, 'p50')} / {g(ttft, 'p99')}</td><td>{g(itl, 'p50')} / {g(itl, 'p99')}"
            f"</td><td>{g(lat, 'p50')} / {g(lat, 'p90')} / {g(lat, 'p99')} / {g(lat, 'p99_9')}"
            f"</td><td>{g(lat, 'max')}</td><td>{s['error_rate']:.1%} ({s['rejected']} rejected,"
            f" {s['failed']} failed, {s['timeout']} timed out)</td>"
            f"<td>{s['client_cpu_max']:.0%}</td>{_cost_cells(p)}</tr>")
    return "<table>" + head + "".join(rows) + "</table>"


def _distribution_plots(job: str, data: dict) -> list[str]:
    out = []
    if data.get("latency_hist"):
        edges, counts = data["latency_hist"]
        out.append(svg.bars(f"{job}-hist", f"{job}: request latency", "latency (ms)",
                            "requests", edges, counts))
    if data.get("latency_cdf"):
        series = {k: [tuple(p) for p in v] for k, v in data["latency_cdf"].items()}
        out.append(svg.lines(f"{job}-cdf", f"{job}: latency CDF", "latency (ms)",
                             "fraction of requests", series, markers=False))
    return out


def _perf(data: dict) -> list[str]:
    out = []
    for mode, x_label in (("concurrency", "concurrent users"), ("rate", "offered req/s")):
        pts = [p for p in data.get("points", []) if p["mode"] == mode]
        if not pts:
            continue
        xs = [p["load"] for p in pts]

        def ser(path, pts=pts, xs=xs):
            from moepipe.validate.stats import figure

            return [(x, figure(p["summary"], path)) for x, p in zip(xs, pts, strict=True)]

        out.append(svg.lines(f"perf-{mode}-latency", f"latency vs {mode}", x_label, "ms",
                             {"latency p50": ser("latency_ms.p50"),
                              "latency p99": ser("latency_ms.p99"),
                              "TTFT p99": ser("ttft_ms.p99")}))
        out.append(svg.lines(f"perf-{mode}-throughput", f"throughput vs {mode}", x_label,
                             "per second", {"output tokens/s": ser("output_tokens_per_s"),
                                            "requests/s x10": [(x, None if y is None else
                                                                y * 10) for x, y in
                                                               ser("requests_per_s")]}))
    return out


def _burst(data: dict) -> list[str]:
    rows = data.get("timeline", [])
    if not rows:
        return []
    band = [(data["burst"][0], data["burst"][1], f"{data.get('factor', '')}x")]
    return [
        svg.lines("burst-latency", "burst: p99 latency over time", "seconds", "ms",
                  {"p99": [(r["t"], r["p99_ms"]) for r in rows],
                   "p50": [(r["t"], r["p50_ms"]) for r in rows]}, bands=band),
        svg.lines("burst-outcomes", "burst: requests per time bin", "seconds", "requests",
                  {k: [(r["t"], r[k]) for r in rows]
                   for k in ("ok", "rejected", "failed", "timeout", "not_sent")},
                  markers=False, bands=band)]


def _balance(data: dict) -> list[str]:
    out = []
    if data.get("layer_expert"):
        m = data["layer_expert"]
        out.append(heatmap("balance-experts", "expert load share (layer x expert)",
                           "expert", "layer", m, [str(i) for i in range(len(m[0]))],
                           [str(i) for i in range(len(m))]))
    if data.get("layer_rank"):
        m = data["layer_rank"]
        out.append(heatmap("balance-ranks", "load share per EP rank (layer x rank)",
                           "EP rank", "layer", m, [str(i) for i in range(len(m[0]))],
                           [str(i) for i in range(len(m))]))
    return out


def _recovery(data: dict) -> list[str]:
    out = []
    for run in data.get("runs", []):
        rows = run.get("timeline", [])
        if rows:
            out.append(svg.lines(f"recovery-{run['kill']}", f"recovery: {run['kill']} killed",
                                 "seconds", "requests",
                                 {k: [(r["t"], r[k]) for r in rows] for k in ("ok", "failed")},
                                 markers=False,
                                 bands=[(run["killed_at"], run.get("served_at") or
                                         run["killed_at"], "down")]))
    return out


def _soak(data: dict) -> list[str]:
    out = []
    rows = data.get("timeline", [])
    if rows:
        out.append(svg.lines("soak-latency", "soak: latency over the run", "seconds", "ms",
                             {"p99": [(r["t"], r["p99_ms"]) for r in rows],
                              "p50": [(r["t"], r["p50_ms"]) for r in rows]}, markers=False))
        out.append(svg.lines("soak-outcomes", "soak: requests per time bin", "seconds",
                             "requests", {k: [(r["t"], r[k]) for r in rows]
                                          for k in ("ok", "rejected", "failed", "timeout",
                                                    "not_sent")}, markers=False))
    for key, name, unit in (("memory", "soak-memory", "RSS of the deployment (MiB)"),
                            ("kv_use", "soak-kv", "KV use (slots or blocks)")):
        d = data.get(key)
        if not d or not d.get("samples"):
            continue
        pts = [tuple(p) for p in d["samples"]]
        line = _fit(pts, data["window_s"])
        series = {"measured": pts,
                  "trend after warm-up": [(t, None if line is None or t < data["window_s"]
                                           else line[0] * t + line[1]) for t, _ in pts]}
        if key == "kv_use" and data.get("kv_total"):
            series["capacity"] = [(t, data["kv_total"]) for t, _ in pts]
        out.append(svg.lines(name, f"soak: {unit.split(' (')[0]}, "
                             f"{d['slope_per_hour']:+.3g} {d['unit']}/h", "seconds", unit,
                             series, markers=False))
    return out


def _fit(pts: list[tuple[float, float]], after: float) -> tuple[float, float] | None:
    """(slope, intercept) of the least-squares line through the points after ``after``."""
    import numpy as np

    use = np.array([p for p in pts if p[0] >= after], dtype=float)
    if len(use) < 2 or np.ptp(use[:, 0]) <= 0:
        return None
    slope, icept = np.polyfit(use[:, 0], use[:, 1], 1)
    return float(slope), float(icept)


PLOTS = {"perf": _perf, "burst": _burst, "balance": _balance, "recovery": _recovery,
         "soak": _soak}


def render(report: dict) -> str:
    """The whole page for a report dict (``Report.to_dict()``)."""
    parts = [f"<h1>moepipe validate: <span class=\"{'passed' if report['passed'] else 'failed'}"
             f"\">{'PASSED' if report['passed'] else 'FAILED'}</span></h1>",
             f"<p>target <b>{escape(report['target'])}</b>, endpoint "
             f"{escape(str(report['endpoint']))}, started "
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(report['started']))}</p>"]
    parts.append("<h2>Summary</h2><table><tr><th>job</th><th>result</th><th>checks</th></tr>"
                 + "".join(f'<tr><td><a href="#{escape(j["job"])}">{escape(j["job"])}</a></td>'
                           f'<td class="{"passed" if j["passed"] else "failed"}">'
                           f'{"passed" if j["passed"] else "FAILED"}</td>'
                           f'<td>{len(j["cases"])}</td></tr>' for j in report["jobs"])
                 + "</table>")
    for job in report["jobs"]:
        data = job.get("data") or {}
        parts.append(f'<h2 id="{escape(job["job"])}">{escape(job["job"])}</h2>')
        if data.get("note"):
            parts.append(f"<p>{escape(data['note'])}</p>")
        parts.append(_case_rows(job))
        if data.get("points"):
            parts.append(_point_table(data["points"]))
        plots = PLOTS.get(job["job"], lambda d: [])(data) + _distribution_plots(job["job"], data)
        if plots:
            parts.append('<div class="plots">' + "".join(plots) + "</div>")
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>moepipe validate</title><style>" + CSS + "</style></head><body>"
            + "".join(parts) + "<script>" + SCRIPT + "</script></body></html>\n")
