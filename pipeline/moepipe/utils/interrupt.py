"""Signals that end a moepipe process: SIGINT (Ctrl-C), SIGTERM (``docker stop``, systemd,
kubectl) and SIGHUP (the terminal went away).

Inside :func:`handled` the first of them raises :class:`Interrupted` in the main thread, wherever
it is (a ready loop, a sleep, a restart), so that every ``finally`` and ``except BaseException``
that stops what the process started runs. A later signal does not interrupt that clean-up - a
second Ctrl-C in the middle of stopping a server would orphan it - but asks it to
:func:`hurry` (kill instead of waiting for a graceful exit). The exit status is 128 + the
signal's number: 130 (INT), 143 (TERM), 129 (HUP).

``Interrupted`` is not a ``KeyboardInterrupt``: click turns those into a silent ``Abort`` and
prints an empty line; this one reaches :func:`moepipe.cli.main`, which says it in one line.
A signal that is ignored when :func:`handled` starts (``nohup``, a shell's background job) stays
ignored.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_received: list[int] = []


class Interrupted(BaseException):
    """A signal asked the process to stop (raised once, by the first signal)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def line(self) -> str:
        """What the CLI prints: ``interrupted`` for Ctrl-C, else which signal."""
        name = signal.Signals(self.signum).name
        return "interrupted" if self.signum == signal.SIGINT else f"interrupted by {name}"


def _handler(signum: int, frame: object) -> None:
    _received.append(signum)
    if len(_received) == 1:
        raise Interrupted(signum)
    # A later signal: the first one's clean-up is running; hurry() tells it to kill.


def hurry() -> bool:
    """Whether a second signal asked a running clean-up not to wait for graceful exits."""
    return len(_received) > 1


def received() -> int | None:
    """The first signal received inside :func:`handled` (None: none)."""
    return _received[0] if _received else None


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into :class:`Interrupted` for the block (see the
    module's docstring); the previous handlers are back afterwards."""
    previous = {}
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if current in (signal.SIG_DFL, signal.default_int_handler):
            previous[sig] = current
            signal.signal(sig, _handler)
    _received.clear()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _received.clear()
