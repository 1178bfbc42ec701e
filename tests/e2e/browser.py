"""Open a page in Debian's headless chromium: its console, its DOM after scripts ran, and a
screenshot. Each run uses a fresh profile and no network services."""

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


@dataclass
class Page:
    dom: str
    console: list[str]  # every console message and uncaught error, as chromium logged it
    screenshot: Path


def chromium() -> str | None:
    return shutil.which("chromium")


# The mark of a test that opens a page: skipped, visibly, where chromium is missing.
needs_chromium = pytest.mark.skipif(chromium() is None, reason="chromium is not installed "
                                    "(scripts/install-test-tools.sh installs it)")


def _run(url: str, extra: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="moepipe-chromium-") as profile:
        return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}",
                               "--enable-logging=stderr", "--v=0", *extra, url],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "HOME": profile})


def open_page(html: Path, out: Path, width: int = 1280) -> Page:
    url = html.resolve().as_uri()
    # the same width for both runs: the charts wrap by width, so their boxes stay valid
    dump = _run(url, ["--dump-dom", f"--window-size={width},2000"])
    console = [line for line in dump.stderr.splitlines() if ":CONSOLE" in line]
    height = 2000
    boxes = re.search(r'data-plots="([^"]*)"', dump.stdout)
    if boxes and boxes.group(1):
        height = max(int(b.split(",")[2]) + int(b.split(",")[4])
                     for b in boxes.group(1).split(";")) + 40
    shot = out / "page.png"
    snap = _run(url, [f"--window-size={width},{height}", f"--screenshot={shot}"])
    console += [line for line in snap.stderr.splitlines() if ":CONSOLE" in line]
    return Page(dump.stdout, console, shot)


def plot_boxes(dom: str) -> list[tuple[str, int, int, int, int, int]]:
    """(name, left, top, width, height, svg elements) of each chart, measured by the page."""
    found = re.search(r'data-plots="([^"]*)"', dom)
    if not found or not found.group(1):
        return []
    out = []
    for item in found.group(1).split(";"):
        name, *nums = item.split(",")
        out.append((name, *map(int, nums)))
    return out
