"""Progress of long work (conversion bytes, training steps, validation requests): the code that
does the work counts, the command line shows it.

Work opens a task and advances it per block, layer or step::

    with progress.task("convert", total=nbytes, unit="bytes") as t:
        for block in blocks:
            ...
            t.advance(len(block))

Counting is one addition under a lock: cheap enough for every block of a hot loop, from any
thread. Nothing is shown unless a view is installed (:func:`install`; the command line installs
one: a bar on a terminal, an occasional line in a log, nothing under ``-q``). A view reads the
counts at its own pace, so the work never waits for rendering. Like a logger, this is
process-wide: code deep in a call (the load driver) advances :func:`current` task, the one its
caller opened, without being handed it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Protocol


class Task:
    """One piece of work being counted: ``done`` of ``total`` ``unit`` (``"bytes"`` shows as
    bytes; ``total`` None: unknown), and a ``note`` saying what it is at."""

    def __init__(self, label: str, total: float | None = None, unit: str = "",
                 note: str = ""):
        self.label, self.total, self.unit, self.note = label, total, unit, note
        self.done = 0.0
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def advance(self, amount: float = 1) -> None:
        """Count ``amount`` more done (thread-safe)."""
        with self._lock:
            self.done += amount

    def plan(self, amount: float) -> None:
        """Add ``amount`` to the total (work that reveals its size as it goes; a negative
        amount takes back what was planned and will not be done)."""
        with self._lock:
            self.total = (self.total or 0) + amount

    def say(self, note: str) -> None:
        """What the task is at now (a rank, a layer, a check)."""
        self.note = note


class View(Protocol):
    """What shows tasks: told when one opens and when it closes; it reads their counts."""

    def opened(self, task: Task) -> None: ...

    def closed(self, task: Task) -> None: ...


_view: View | None = None
_open: list[Task] = []
_open_lock = threading.Lock()
IDLE = Task("")  # what current() gives when no task is open: counts go nowhere


def install(view: View | None) -> View | None:
    """Show tasks in ``view`` from now on (None: nowhere); returns the view it replaces."""
    global _view
    old, _view = _view, view
    return old


@contextlib.contextmanager
def task(label: str, total: float | None = None, unit: str = "",
         note: str = "") -> Iterator[Task]:
    """Open a task for the block; the installed view shows it until the block ends."""
    t = Task(label, total, unit, note)
    view = _view
    with _open_lock:
        _open.append(t)
    if view is not None:
        view.opened(t)
    try:
        yield t
    finally:
        with _open_lock:
            _open.remove(t)
        if view is not None:
            view.closed(t)


def current() -> Task:
    """The innermost open task (a task that counts into nothing when none is open)."""
    with _open_lock:
        return _open[-1] if _open else IDLE
