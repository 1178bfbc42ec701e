"""An HTTP/1.1 response read from an asyncio stream, as RFC 9112 frames it: the status line,
the header fields, then the body by ``Transfer-Encoding: chunked`` (chunk extensions and
trailers skipped), by ``Content-Length``, or up to the end of the connection; and the
server-sent events of a streaming body (Triton's ``generate_stream``).

The body comes out in the pieces the framing gives, which say nothing about the events inside
them (a proxy may split or merge them): :class:`moepipe.utils.sse.SSEParser` finds those.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from moepipe.utils.sse import EventTooLarge, SSEParser

_PIECE = 64 << 10


class ProtocolError(ValueError):
    """The peer's bytes are not an HTTP/1.1 response."""


async def _line(reader: asyncio.StreamReader) -> bytes:
    line = await reader.readline()
    if not line.endswith(b"\n"):  # (asyncio refuses a line over its limit by itself)
        raise ProtocolError("the connection closed in the middle of the response")
    return line.rstrip(b"\r\n")


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """(status code, header fields with lower-case names) of the response."""
    status = await _line(reader)
    parts = status.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.1 status line: {status[:80]!r}")
    headers: dict[str, str] = {}
    while line := await _line(reader):
        name, colon, value = line.decode("latin-1").partition(":")
        if not colon:
            raise ProtocolError(f"not a header field: {line[:80]!r}")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return int(parts[1]), headers


async def body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body's bytes, piece by piece, ending where the framing says it ends (a server may
    keep the connection open after a chunked body's last chunk)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = (await _line(reader)).split(b";", 1)[0].strip()
            if not size_line or size_line.strip(b"0123456789abcdefABCDEF"):  # hex digits only
                raise ProtocolError(f"not a chunk size: {size_line[:40]!r}")
            size = int(size_line, 16)
            if size == 0:
                while await _line(reader):  # trailer fields, up to the blank line
                    pass
                return
            while size:
                piece = await reader.read(min(size, _PIECE))
                if not piece:
                    raise ProtocolError("the connection closed inside a chunk")
                size -= len(piece)
                yield piece
            if await _line(reader):
                raise ProtocolError("a chunk is longer than its size says")
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left:
            piece = await reader.read(min(left, _PIECE))
            if not piece:
                raise ProtocolError(f"the connection closed {left} bytes before the body's end")
            left -= len(piece)
            yield piece
    else:
        while piece := await reader.read(_PIECE):
            yield piece


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """The whole body."""
    return b"".join([piece async for piece in body(reader, headers)])


async def json_events(reader: asyncio.StreamReader,
                      headers: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
    """The body's server-sent events, each one's data a JSON object (Triton's
    ``generate_stream``), as the events complete."""
    parser = SSEParser()
    try:
        async for piece in body(reader, headers):
            for event in parser.feed(piece):
                yield _json_object(event.data)
        for event in parser.close():
            yield _json_object(event.data)
    except EventTooLarge as e:  # the reader's memory stays bounded: the request fails
        raise ProtocolError(str(e)) from None


def _json_object(data: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ProtocolError(f"an event whose data is not a JSON object: {data[:80]!r}")
    return value


def error_text(answer: bytes) -> str:
    """The ``error`` of an answer that refused a request: a JSON object, or events of one
    (empty when it has none)."""
    parser = SSEParser()
    for text in [answer.decode(errors="replace"),
                 *(e.data for e in [*parser.feed(answer), *parser.close()])]:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict) and "error" in value:
            return str(value["error"])
    return answer[:200].decode(errors="replace").strip()
