"""Inline SVG charts for the HTML report: no JavaScript library, no network, no fonts to load.

Each chart is an ``<svg class="plot">`` element with its axes, ticks, labels and a legend.
"""

from __future__ import annotations

import math
from html import escape

W, H = 560, 300
PAD_L, PAD_R, PAD_T, PAD_B = 62, 16, 30, 44
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
          "#17becf"]


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.3g}"


def _frame(title: str, x_label: str, y_label: str, body: list[str], name: str) -> str:
    return (f'<svg class="plot" data-plot="{escape(name)}" xmlns="http://www.w3.org/2000/svg" '
            f'width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">'
            f'<title>{escape(title)}</title><rect width="{W}" height="{H}" fill="#fff"/>'
            f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13" '
            f'font-weight="bold">{escape(title)}</text>'
            f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{H - 6}" text-anchor="middle" '
            f'font-size="11">{escape(x_label)}</text>'
            f'<text transform="translate(13,{(PAD_T + H - PAD_B) / 2}) rotate(-90)" '
            f'text-anchor="middle" font-size="11">{escape(y_label)}</text>'
            + "".join(body) + "</svg>")


class _Axes:
    def __init__(self, xs: list[float], ys: list[float], y0: bool = True):
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        self.y0, self.y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if y0:
            self.y0 = min(0.0, self.y0)
        if self.x1 <= self.x0:  # one point: centre it
            self.x0, self.x1 = self.x0 - 1.0, self.x1 + 1.0
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1.0
        self.y1 += (self.y1 - self.y0) * 0.05

    def x(self, v: float) -> float:
        return PAD_L + (v - self.x0) / (self.x1 - self.x0) * (W - PAD_L - PAD_R)

    def y(self, v: float) -> float:
        return H - PAD_B - (v - self.y0) / (self.y1 - self.y0) * (H - PAD_T - PAD_B)

    def grid(self) -> list[str]:
        out = [f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" '
               'stroke="#333"/>',
               f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" stroke="#333"/>']
        for t in _ticks(self.x0, self.x1):
            x = self.x(t)
            out.append(f'<line x1="{x:.1f}" y1="{H - PAD_B}" x2="{x:.1f}" y2="{H - PAD_B + 4}" '
                       f'stroke="#333"/><text x="{x:.1f}" y="{H - PAD_B + 15}" font-size="10" '
                       f'text-anchor="middle">{_fmt(t)}</text>')
        for t in _ticks(self.y0, self.y1):
            y = self.y(t)
            out.append(f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" '
                       f'stroke="#e5e5e5"/><text x="{PAD_L - 5}" y="{y + 3:.1f}" '
                       f'font-size="10" text-anchor="end">{_fmt(t)}</text>')
        return out


def _legend(names: list[str]) -> list[str]:
    out = []
    for i, name in enumerate(names):
        y = PAD_T + 6 + 14 * i
        out.append(f'<rect x="{W - PAD_R - 150}" y="{y - 8}" width="10" height="10" '
                   f'fill="{COLORS[i % len(COLORS)]}"/><text x="{W - PAD_R - 136}" y="{y + 1}" '
                   f'font-size="10">{escape(name)}</text>')
    return out


def lines(name: str, title: str, x_label: str, y_label: str,
          series: dict[str, list[tuple[float, float | None]]], markers: bool = True,
          bands: list[tuple[float, float, str]] | None = None) -> str:
    """Line chart of named (x, y) series; ``bands`` shade x ranges (e.g. a burst)."""
    bands = bands or []
    pts = [(x, y) for s in series.values() for x, y in s if y is not None]
    ax = _Axes([p[0] for p in pts] + [b for band in bands for b in band[:2]],
               [p[1] for p in pts])
    body = []
    for lo, hi, label in bands:
        body.append(f'<rect x="{ax.x(lo):.1f}" y="{PAD_T}" width="{ax.x(hi) - ax.x(lo):.1f}" '
                    f'height="{H - PAD_T - PAD_B}" fill="#fde8c8"/><text x="{ax.x(lo) + 3:.1f}" '
                    f'y="{PAD_T + 10}" font-size="10">{escape(label)}</text>')
    body += ax.grid()
    for i, data in enumerate(series.values()):
        color = COLORS[i % len(COLORS)]
        segs: list[list[str]] = []
        cur: list[str] = []
        for x, y in data:
            if y is None:
                segs, cur = segs + [cur] if cur else segs, []
            else:
                cur.append(f"{ax.x(x):.1f},{ax.y(y):.1f}")
        segs += [cur] if cur else []
        for seg in segs:
            body.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                        f'points="{" ".join(seg)}"/>')
            if markers:
                body += [f'<circle cx="{p.split(",")[0]}" cy="{p.split(",")[1]}" r="3" '
                         f'fill="{color}"/>' for p in seg]
    body += _legend(list(series))
    return _frame(title, x_label, y_label, body, name)


def bars(name: str, title: str, x_label: str, y_label: str, edges: list[float],
         counts: list[int]) -> str:
    """Histogram: bars between consecutive edges."""
    ax = _Axes(edges, [float(c) for c in counts])
    body = ax.grid()
    for lo, hi, c in zip(edges, edges[1:], counts, strict=False):
        x0, x1, y = ax.x(lo), ax.x(hi), ax.y(c)
        body.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0 - 1, 1):.1f}" '
                    f'height="{H - PAD_B - y:.1f}" fill="{COLORS[0]}"/>')
    return _frame(title, x_label, y_label, body, name)
