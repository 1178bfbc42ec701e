"""How the command line shows the progress of long work (:mod:`moepipe.utils.progress`).

* On a terminal (stderr is a tty): a bar per open task with done / total (bytes as kB, MB,
  GB), the rate and the time left, redrawn a few times a second by rich's own thread from the
  tasks' counts; it is erased when the task ends (the command prints its summary line).
* Elsewhere (CI logs, pipes): a plain line at most every :data:`LINE_INTERVAL_S`, for the
  innermost task that has run that long; short work prints nothing.
* Under ``-q``: nothing (the command line installs no view).

Bars and lines go to stderr: with ``--json``, stdout carries the JSON object only.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO, Any

from moepipe.utils.progress import Task

# Seconds between two plain lines (and before the first): a log gets a line now and then.
LINE_INTERVAL_S = 30.0


def _scale(n: float) -> tuple[float, str]:
    """The decimal byte unit for ``n`` (as rich's, kB = 1000 bytes)."""
    for power, suffix in enumerate(("bytes", "kB", "MB", "GB", "TB")):
        if n < 1000 ** (power + 1):
            return 1000.0 ** power, suffix
    return 1000.0 ** 5, "PB"


def _amount(value: float, unit: str) -> str:
    if unit == "bytes":
        scale, suffix = _scale(value)
        return f"{value:,.0f} bytes" if scale == 1 else f"{value / scale:.1f} {suffix}"
    return f"{value:,.0f}"


def describe(t: Task) -> str:
    """The task's label and what it is at."""
    return f"{t.label}: {t.note}" if t.note else t.label


def clock(seconds: float) -> str:
    """H:MM:SS."""
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


def line(t: Task, now: float) -> str:
    """One plain line: ``convert: 1.2 GB of 9.0 GB (13%), 120.0 MB/s, 0:01:05 left (0 of 4
    rank files written)``."""
    elapsed = max(now - t.started, 1e-9)
    rate = t.done / elapsed
    per_s = f"{_amount(rate, t.unit)}/s" if t.unit == "bytes" else f"{rate:.1f} {t.unit}/s"
    unit = "" if t.unit == "bytes" else f" {t.unit}"
    if t.total:
        left = clock((t.total - t.done) / rate) if rate > 0 else "-:--:--"
        text = (f"{_amount(t.done, t.unit)} of {_amount(t.total, t.unit)}{unit} "
                f"({t.done / t.total:.0%}), {per_s}, {left} left")
    elif t.unit:
        text = f"{_amount(t.done, t.unit)}{unit}, {per_s}, {clock(elapsed)} so far"
    else:
        text = f"running for {clock(elapsed)}"
    return f"{t.label}: {text}" + (f" ({t.note})" if t.note else "")


class LineView:
    """Plain lines now and then on ``stream`` (stderr), from a thread of its own."""

    def __init__(self, stream: IO[str] | None = None, interval: float = LINE_INTERVAL_S):
        self._stream, self._interval = stream, interval
        self._open: list[Task] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def opened(self, task: Task) -> None:
        with self._lock:
            self._open.append(task)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True)
                self._thread.start()

    def closed(self, task: Task) -> None:
        with self._lock:
            self._open.remove(task)

    def tick(self, now: float) -> str | None:
        """The line due at ``now``, if any: the innermost task's, once it ran an interval."""
        with self._lock:
            t = self._open[-1] if self._open else None
        if t is None or now - t.started < self._interval:
            return None
        return line(t, now)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            text = self.tick(time.monotonic())
            if text is not None:
                stream = self._stream or sys.stderr
                stream.write(f"moepipe: {text}\n")
                stream.flush()

    def close(self) -> None:
        self._stop.set()


def _columns() -> tuple:
    """rich's spinner, label and bar, then done / total with the rate, then the time left."""
    from rich.progress import BarColumn, ProgressColumn, SpinnerColumn, TextColumn
    from rich.text import Text

    class Counts(ProgressColumn):
        """``1.2/9.0 GB  120.0 MB/s`` or ``31/48 requests  4.1 requests/s``."""

        def render(self, task):
            unit = task.fields.get("unit", "")
            if not unit or (task.total is None and not task.completed):
                return Text("")
            speed = task.finished_speed or task.speed
            if unit == "bytes":  # both in the total's unit: 1.2/9.0 GB
                scale, suffix = _scale(task.total or task.completed)
                digits = 0 if scale == 1 else 1
                total = "" if task.total is None else f"/{task.total / scale:.{digits}f}"
                text = f"{task.completed / scale:.{digits}f}{total} {suffix}"
                rate = None if speed is None else f"{_amount(speed, unit)}/s"
            else:
                total = "" if task.total is None else f"/{task.total:,.0f}"
                text = f"{task.completed:,.0f}{total} {unit}"
                rate = None if speed is None else f"{speed:.1f} {unit}/s"
            return Text(text + (f"  {rate}" if rate else ""), style="progress.download")

    class Left(ProgressColumn):
        """``0:01:05 left`` with a total, else the time so far."""

        max_refresh = 0.5  # as rich's own remaining-time column: no jitter

        def render(self, task):
            if task.total is None:
                return Text(clock(task.elapsed or 0), style="progress.elapsed")
            left = task.time_remaining
            return Text(f"{'-:--:--' if left is None else clock(left)} left",
                        style="progress.remaining")

    class Bar(BarColumn):
        """rich's bar once the total is known (no pulsing bar for work of unknown size)."""

        def render(self, task):
            return Text("") if task.total is None else super().render(task)

    return (SpinnerColumn(), TextColumn("{task.description}", markup=False),
            Bar(bar_width=28), Counts(), Left())


class BarView:
    """rich progress bars on stderr while tasks are open, stopped between tasks (so the
    command's own lines print normally). rich's thread redraws them a few times a second."""

    def __init__(self, console: Any = None, get_time: Any = None):
        from rich.console import Console
        from rich.progress import Progress

        view = self

        class Synced(Progress):
            def get_renderables(self):  # on rich's thread, before each redraw
                view.sync()
                return super().get_renderables()

        self._ids: dict[Task, Any] = {}
        self._lock = threading.Lock()  # opened / closed from any thread, one at a time
        # Lines printed to stdout while a bar shows go above it when stdout is the same
        # terminal; a redirected stdout (a file, a pipe, --json) is left alone.
        self.progress = Synced(*_columns(), console=console or Console(stderr=True),
                               transient=True, refresh_per_second=8, get_time=get_time,
                               redirect_stdout=sys.stdout.isatty())

    def sync(self) -> None:
        """Copy the tasks' counts into rich's (its rate estimate samples them). Called under
        rich's display lock, so it takes no lock of its own (opened() and closed() hold
        theirs while they call rich): a task closed meanwhile is skipped."""
        for t, tid in list(self._ids.items()):
            try:
                self.progress.update(tid, completed=t.done, total=t.total,
                                     description=describe(t))
            except KeyError:  # removed from rich since the copy
                continue

    def opened(self, task: Task) -> None:
        with self._lock:
            self._ids[task] = self.progress.add_task(describe(task), total=task.total,
                                                     unit=task.unit)
            if len(self._ids) == 1:
                self.progress.start()

    def closed(self, task: Task) -> None:
        with self._lock:
            self.sync()
            self.progress.refresh()  # its last counts are drawn once
            self.progress.remove_task(self._ids.pop(task))
            if not self._ids:
                self.progress.stop()

    def close(self) -> None:
        with self._lock:
            self._ids.clear()
            self.progress.stop()


def progress_view(quiet: bool, stream: IO[str] | None = None) -> BarView | LineView | None:
    """The view for this run: none under ``-q``, bars when stderr is a terminal, else lines."""
    if quiet:
        return None
    if sys.stderr.isatty() and os.environ.get("TERM") != "dumb":
        return BarView()
    return LineView(stream)
