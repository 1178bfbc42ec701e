"""The report's layer x expert (or layer x rank) heatmap, readable from a 2 x 8 toy to
DeepSeek-V3's 58 x 256 and beyond.

* The frame grows with the matrix, within the page (cells 2-40 px wide, 5-28 px high: a 61 x
  256 map is about 1000 x 500 px of cells).
* A diverging colour scale centred on the even share (1 / columns) when the values are shares:
  blue below even, white at even, red above (saturating at 3x even or the maximum, whichever is
  larger), so a hot or a starved expert stands out; a legend bar with its ticks beside it.
* Every cell has a tooltip (an SVG ``<title>``: row, column, value, x even), no script needed.
* Axis labels are thinned to every 1st, 2nd, 4th, 8th, ... row and column so that they never
  overlap; values are written into cells only where they fit.
"""

from __future__ import annotations

import math
from html import escape

PAD_L, PAD_T, PAD_B, GAP, LEGEND_W, PAD_R = 62, 30, 44, 16, 14, 84
GRID_W, GRID_H = 1000, 500  # the most the cells take before they shrink
CELL_W, CELL_H = (2.0, 40.0), (5.0, 28.0)  # min, max
BLUE, WHITE, RED = (59, 76, 192), (247, 247, 247), (180, 4, 38)  # Moreland's cool-warm ends


def _mix(a: tuple[int, ...], b: tuple[int, ...], t: float) -> str:
    t = min(1.0, max(0.0, t))
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(a, b, strict=True))


class Scale:
    """Value -> colour: diverging around ``centre`` (when given), else white -> red."""

    def __init__(self, top: float, centre: float | None):
        self.centre = centre
        self.top = max(top, 3 * centre if centre else top) or 1.0

    def colour(self, v: float) -> str:
        if self.centre is None:
            return _mix(WHITE, RED, v / self.top)
        if v < self.centre:
            return _mix(BLUE, WHITE, v / self.centre)
        return _mix(WHITE, RED, (v - self.centre) / (self.top - self.centre))

    def ticks(self) -> list[float]:
        return [0.0, self.centre, self.top] if self.centre else [0.0, self.top / 2, self.top]


def _step(n: int, cell: float, room: float) -> int:
    """Every how many labels one is drawn: 1, 2, 4, 8, ... so that labels are ``room`` apart."""
    step = 1
    while step < n and step * cell < room:
        step *= 2
    return step


def _fmt(v: float, share: bool) -> str:
    return f"{v:.2%}" if share else f"{v:.3g}"


def heatmap(name: str, title: str, x_label: str, y_label: str,
            matrix: list[list[float]], x_names: list[str], y_names: list[str],
            share: bool = True) -> str:
    """An ``<svg class="plot">``. ``share``: the rows are shares of a whole (each row's even
    share is 1 / columns, the scale's centre); otherwise a plain white-to-red scale."""
    rows, cols = len(matrix), max((len(r) for r in matrix), default=0)
    top = max((v for row in matrix for v in row), default=0.0)
    scale = Scale(top, 1.0 / cols if share and cols else None)
    cw = min(CELL_W[1], max(CELL_W[0], GRID_W / max(cols, 1)))
    ch = min(CELL_H[1], max(CELL_H[0], GRID_H / max(rows, 1)))
    gw, gh = cw * cols, ch * rows
    W = math.ceil(PAD_L + gw + GAP + LEGEND_W + PAD_R)
    H = math.ceil(PAD_T + max(gh, 120) + PAD_B)
    body = [f'<g class="cells" transform="translate({PAD_L},{PAD_T}) scale({cw:g},{ch:g})" '
            'shape-rendering="crispEdges">']
    even = scale.centre
    for i, row in enumerate(matrix):
        for j, v in enumerate(row):
            ratio = f" ({v / even:.1f}x even)" if even else ""
            body.append(f'<rect x="{j}" y="{i}" width="1" height="1" fill="{scale.colour(v)}">'
                        f'<title>{escape(y_label)} {escape(y_names[i])}, {escape(x_label)} '
                        f'{escape(x_names[j])}: {_fmt(v, share)}{ratio}</title></rect>')
    body.append("</g>")
    if cw > 34 and ch > 14:  # room for the value itself
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                body.append(f'<text x="{PAD_L + (j + 0.5) * cw:.1f}" '
                            f'y="{PAD_T + (i + 0.5) * ch + 3:.1f}" font-size="9" '
                            f'text-anchor="middle" pointer-events="none">'
                            f'{_fmt(v, share)}</text>')
    body += _labels(x_names, y_names, cw, ch, gh)
    body += _legend(name, scale, PAD_L + gw + GAP, max(gh, 120), share)
    return (f'<svg class="plot" data-plot="{escape(name)}" data-kind="heatmap" '
            f'data-grid="{PAD_L},{PAD_T},{cw:g},{ch:g},{rows},{cols}" '
            f'xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
            f'viewBox="0 0 {W} {H}" role="img"><title>{escape(title)}</title>'
            f'<rect width="{W}" height="{H}" fill="#fff"/>'
            f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13" '
            f'font-weight="bold">{escape(title)}</text>'
            f'<text x="{PAD_L + gw / 2:.1f}" y="{H - 6}" text-anchor="middle" '
            f'font-size="11">{escape(x_label)}</text>'
            f'<text transform="translate(13,{PAD_T + gh / 2:.1f}) rotate(-90)" '
            f'text-anchor="middle" font-size="11">{escape(y_label)}</text>'
            + "".join(body) + "</svg>")


def _labels(x_names: list[str], y_names: list[str], cw: float, ch: float,
            gh: float) -> list[str]:
    out = []
    width = max((len(n) for n in x_names), default=1) * 6 + 6  # 10 px font: ~6 px a digit
    xs = _step(len(x_names), cw, width)
    for j in range(0, len(x_names), xs):
        x = PAD_L + (j + 0.5) * cw
        out.append(f'<text class="xlabel" x="{x:.1f}" y="{PAD_T + gh + 14:.1f}" '
                   f'font-size="10" text-anchor="middle">{escape(x_names[j])}</text>')
    ys = _step(len(y_names), ch, 12)
    for i in range(0, len(y_names), ys):
        y = PAD_T + (i + 0.5) * ch + 3
        out.append(f'<text class="ylabel" x="{PAD_L - 5}" y="{y:.1f}" font-size="10" '
                   f'text-anchor="end">{escape(y_names[i])}</text>')
    return out


def _legend(name: str, scale: Scale, x: float, height: float, share: bool) -> list[str]:
    """A vertical colour bar (top: the largest value) with its ticks."""
    stops = 24
    grad = "".join(f'<stop offset="{k / stops:.3f}" '
                   f'stop-color="{scale.colour(scale.top * (1 - k / stops))}"/>'
                   for k in range(stops + 1))
    gid = f"legend-{escape(name)}"
    out = [f'<g class="legend"><defs><linearGradient id="{gid}" x1="0" y1="0" x2="0" y2="1">'
           f'{grad}</linearGradient></defs>'
           f'<rect x="{x:.1f}" y="{PAD_T}" width="{LEGEND_W}" height="{height:.1f}" '
           f'fill="url(#{gid})" stroke="#999"/>']
    for t in scale.ticks():
        y = PAD_T + height * (1 - t / scale.top)
        label = _fmt(t, share) + (" even" if t == scale.centre else "")
        out.append(f'<line x1="{x + LEGEND_W:.1f}" y1="{y:.1f}" x2="{x + LEGEND_W + 4:.1f}" '
                   f'y2="{y:.1f}" stroke="#333"/><text x="{x + LEGEND_W + 6:.1f}" '
                   f'y="{y + 3:.1f}" font-size="10">{escape(label)}</text>')
    out.append("</g>")
    return out
