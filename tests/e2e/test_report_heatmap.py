"""The report's layer x expert heatmap at MoE scale, opened in headless chromium: 61 layers x
256 experts (DeepSeek-V3 has 58 x 256) fit the page in a frame that grew for them, labels are
thinned so they do not overlap, a legend gives the colour scale, every cell has a tooltip, and
a hot expert shows red and a starved one blue where the page says they are."""

import random
import re

import pytest
from browser import needs_chromium, open_page, plot_boxes

from moepipe.validate.html import render

LAYERS, EXPERTS, RANKS = 61, 256, 8
HOT, COLD = 17, 200  # an expert that gets 6x its even share, one that gets nothing


def _shares() -> list[list[float]]:
    rng = random.Random(25)
    rows = []
    for _ in range(LAYERS):
        w = [rng.uniform(0.5, 1.5) for _ in range(EXPERTS)]
        w[COLD] = 0.0
        w[HOT] = 6.0 * sum(w) / (EXPERTS - 6)  # 6x the even share once normalised
        total = sum(w)
        rows.append([x / total for x in w])
    return rows


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    experts = _shares()
    ranks = [[sum(r[k * 32:(k + 1) * 32]) for k in range(RANKS)] for r in experts]
    report = {"passed": True, "target": "cpu", "endpoint": {"http": "127.0.0.1:1"},
              "started": 0, "jobs": [{"job": "balance", "passed": True, "cases": [],
                                      "data": {"layer_expert": experts,
                                               "layer_rank": ranks}}]}
    out = tmp_path_factory.mktemp("heatmap")
    html = out / "validate.html"
    html.write_text(render(report))
    return open_page(html, out), experts


@needs_chromium
def test_a_61_by_256_heatmap_is_readable(page):
    from PIL import Image  # the test group

    shown, experts = page
    assert shown.console == []
    boxes = {b[0]: b for b in plot_boxes(shown.dom)}
    _, left, top, width, height, _ = boxes["balance-experts"]
    assert 900 <= width <= 1200 and 450 <= height <= 800  # grew, and stays on the page
    svg = re.search(r'<svg class="plot" data-plot="balance-experts" data-kind="heatmap".*?</svg>', shown.dom,
                    re.S).group(0)
    # a tooltip on every cell, saying where and how far from even
    tips = re.findall(r"<title>layer (\d+), expert (\d+): ([\d.]+)% \(([\d.]+)x even\)</title>",
                      svg)
    assert len(tips) == LAYERS * EXPERTS
    hot = next(t for t in tips if t[:2] == ("3", str(HOT)))
    assert float(hot[3]) == pytest.approx(6.0, abs=0.15)
    # thinned labels: a readable number, never closer than a label's width
    xs = [float(x) for x in re.findall(r'class="xlabel" x="([\d.]+)"', svg)]
    ys = [float(y) for y in re.findall(r'class="ylabel" x="[\d.]+" y="([\d.]+)"', svg)]
    assert 8 <= len(xs) <= 40 and 8 <= len(ys) <= 40
    assert min(b - a for a, b in zip(xs, xs[1:], strict=False)) >= 24
    assert min(b - a for a, b in zip(ys, ys[1:], strict=False)) >= 12
    assert "0.39% even" in svg and 'class="legend"' in svg  # the scale's centre: 1/256
    # where the page says the cells are, the screenshot has their colours
    x0, y0, cw, ch, rows, cols = (float(v) for v in re.search(r'data-grid="([^"]+)"', svg)
                                  .group(1).split(","))
    assert (rows, cols) == (LAYERS, EXPERTS)
    image = Image.open(shown.screenshot).convert("RGB")

    def pixel(layer, expert):
        return image.getpixel((round(left + x0 + (expert + 0.5) * cw),
                               round(top + y0 + (layer + 0.5) * ch)))

    for layer in (0, 30, 60):
        r, g, b = pixel(layer, HOT)
        assert r > 150 and g < 90 and b < 90, (layer, (r, g, b))  # red
        r, g, b = pixel(layer, COLD)
        assert b > 150 and r < 100, (layer, (r, g, b))  # blue


@needs_chromium
def test_the_rank_heatmap_has_its_tooltips_and_centre(page):
    shown, _ = page
    svg = re.search(r'<svg class="plot" data-plot="balance-ranks" data-kind="heatmap".*?</svg>', shown.dom,
                    re.S).group(0)
    assert len(re.findall(r"<title>layer \d+, EP rank \d+:", svg)) == LAYERS * RANKS
    assert "12.50% even" in svg
