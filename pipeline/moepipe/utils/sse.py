"""Server-sent events, parsed incrementally as the WHATWG HTML standard says
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation).

Bytes arrive in whatever pieces the network, a proxy or an HTTP client hands over: an event may
be split across pieces and one piece may hold several events. A line ends at CRLF, LF or CR
(a CR at the end of a piece waits for the next byte); a blank line dispatches the event; ``:``
starts a comment; ``data:`` with or without one space after the colon; several ``data`` lines
join with LF; a leading byte-order mark is dropped; an event left without its blank line when
the stream ends is not dispatched.

Standard library only: :mod:`moepipe.deploy` ships this file beside the Locust file of a
deployment, which runs where moepipe may not be installed.
"""

from __future__ import annotations

from dataclasses import dataclass

_BOM = b"\xef\xbb\xbf"
# An event (its unfinished line, or its data lines so far) larger than this is refused: a
# stream that never ends its line must not grow the reader's memory without bound. Triton's
# generate_stream events are far smaller (logits included: ~1.5 MiB for 150k floats).
MAX_EVENT_BYTES = 64 << 20


class EventTooLarge(ValueError):
    """An event, or a line, larger than the parser's bound."""


@dataclass(frozen=True)
class Event:
    """One dispatched event: ``data`` is the joined data lines (without the final LF)."""

    data: str
    event: str = "message"
    id: str = ""  # the last event ID seen so far in the stream (the spec's lastEventId)
    retry: int | None = None  # the last reconnection time (ms) the stream set


class SSEParser:
    """Feed bytes with :meth:`feed`, get the events they complete; :meth:`close` at the end."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._size = 0  # bytes of the current event's data lines
        self._pending = b""  # bytes of an unfinished line
        self._started = False  # the BOM check happens once, on the first three bytes
        self._data: list[str] = []
        self._event = ""
        self._last_id = ""
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[Event]:
        """The events that ``chunk`` completes (in order)."""
        buf = self._pending + chunk
        if not self._started:
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._pending = buf
                return []
            buf = buf.removeprefix(_BOM)
            self._started = True
        events: list[Event] = []
        start, n = 0, len(buf)
        cr = lf = -1
        while start < n:
            # each search runs again only once its hit is behind: linear in the piece
            if cr < start:
                cr = buf.find(b"\r", start)
                cr = n if cr < 0 else cr
            if lf < start:
                lf = buf.find(b"\n", start)
                lf = n if lf < 0 else lf
            if cr == n and lf == n:
                break
            if cr < lf:
                if cr == n - 1:  # a CR last: the next piece may start with its LF
                    break
                end, nxt = cr, cr + 2 if buf[cr + 1:cr + 2] == b"\n" else cr + 1
            else:
                end, nxt = lf, lf + 1
            event = self._line(buf[start:end].decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
            start = nxt
        self._pending = buf[start:]
        if len(self._pending) > self._max:
            raise EventTooLarge(f"a line of over {self._max} bytes without its end")
        return events

    def close(self) -> list[Event]:
        """The end of the stream: a last line ended by a lone CR still counts; an event without
        its blank line is discarded (the standard's rule)."""
        events = []
        if self._pending.endswith(b"\r"):
            events = self.feed(b"\n")
        self._pending, self._data, self._event, self._size = b"", [], "", 0
        return events

    def _line(self, line: str) -> Event | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._size += len(value) + 1
            if self._size > self._max:
                raise EventTooLarge(f"an event of over {self._max} bytes")
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> Event | None:
        data, kind = self._data, self._event
        self._data, self._event, self._size = [], "", 0
        if not data:
            return None
        return Event("\n".join(data), kind or "message", self._last_id, self._retry)
