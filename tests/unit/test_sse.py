"""Server-sent events parsed as the WHATWG standard says, whatever the pieces the bytes come in,
and HTTP/1.1 bodies framed as RFC 9112 says (the load driver's HTTP reader).

The examples are the standard's own (html.spec.whatwg.org, "9.2.6 Interpreting an event
stream" and "9.2.7 Authoring notes"); a real server's stream, re-chunked through a proxy, is in
tests/e2e/test_sse_rechunked.py."""

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moepipe.utils.sse import Event, SSEParser
from moepipe.validate import http1


def parse(stream: bytes, cuts=()) -> list[Event]:
    parser, events, last = SSEParser(), [], 0
    for cut in [*sorted(cuts), len(stream)]:
        events += parser.feed(stream[last:cut])
        last = cut
    return events + parser.close()


def datas(stream: bytes, cuts=()) -> list[str]:
    return [e.data for e in parse(stream, cuts)]


def test_the_standards_examples():
    # several data lines join with LF
    assert datas(b"data: YHOO\ndata: +2\ndata: 10\n\n") == ["YHOO\n+2\n10"]
    # a comment, ids (an empty id resets it), one space dropped after the colon and no more
    events = parse(b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\n"
                   b"data:  third event\n")
    assert [(e.data, e.id) for e in events] == [("first event", "1"), ("second event", "")]
    # `data` alone is an empty data line; an event without its blank line is never dispatched
    assert datas(b"data\n\ndata\ndata\n\ndata:") == ["", "\n"]
    # with and without the space: the same event
    assert datas(b"data:test\n\ndata: test\n\n") == ["test", "test"]


def test_line_endings_comments_fields_and_bom():
    assert datas(b"data: a\r\n\r\ndata: b\r\rdata: c\n\n") == ["a", "b", "c"]
    assert datas(b"\xef\xbb\xbfdata: x\n\n") == ["x"]
    assert datas(b"data: \xef\xbb\xbfx\n\n") == ["\ufeffx"]  # only a leading BOM goes
    events = parse(b"event: token\nretry: 250\nretry: soon\nignored: field\n:keepalive\n"
                   b"data: {\"a\": 1}\n\ndata: 2\n\n")
    assert events == [Event('{"a": 1}', "token", "", 250), Event("2", "message", "", 250)]
    assert parse(b"id: a\0b\ndata: x\n\n")[0].id == ""  # an id with NUL is ignored
    assert datas(b"data: x\n\r") == ["x"]  # a lone CR ends the stream's last line
    assert datas(b"data: \xff\n\n") == ["\ufffd"]  # invalid UTF-8: replacement characters


def test_pieces_do_not_matter_at_any_boundary():
    stream = (b"\xef\xbb\xbf: hello\r\ndata: {\"text_output\": \"\xc3\xa9\"}\r\n\r\n"
              b"data:1\rdata:2\r\rid: 7\nevent: e\ndata: 0\n\ndata: last\n\n")
    whole = parse(stream)
    assert [e.data for e in whole] == ['{"text_output": "\u00e9"}', "1\n2", "0", "last"]
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1):
            assert parse(stream, (i, j)) == whole, (i, j)
    assert parse(stream, range(len(stream))) == whole  # a byte at a time


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["data", "data:", "event: x", ": c", "id: 5", ""]),
                          st.text(alphabet="ab\u00e9 :", max_size=6),
                          st.sampled_from([b"\n", b"\r\n", b"\r"])), max_size=20),
       st.lists(st.integers(0, 400), max_size=12))
def test_any_stream_parses_the_same_in_any_pieces(lines, cuts):
    stream = b"".join((head + (value if head.startswith("data") else "")).encode() + end
                      for head, value, end in lines)
    assert parse(stream, [c for c in cuts if c <= len(stream)]) == parse(stream)


def _reader(raw: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    return reader


def _read(raw: bytes) -> tuple[int, dict, list[dict]]:
    async def go():
        reader = _reader(raw)
        code, headers = await http1.read_head(reader)
        return code, headers, [e async for e in http1.json_events(reader, headers)]
    return asyncio.run(go())


def chunked(body: bytes, sizes) -> bytes:
    out, i = b"", 0
    for size in sizes:
        if i >= len(body):
            break
        out += b"%x;ext=1\r\n" % len(body[i:i + size]) + body[i:i + size] + b"\r\n"
        i += size
    if i < len(body):
        out += b"%x\r\n" % (len(body) - i) + body[i:] + b"\r\n"
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


EVENTS = [{"text_output": "It", "num_output_tokens": 1}, {"text_output": " was"},
          {"text_output": "", "num_output_tokens": [0]}]
SSE = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in EVENTS)
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"


@pytest.mark.parametrize("sizes", [[len(SSE)], [1] * len(SSE), [3, 50, 7, 1, 2], [10_000]])
def test_a_chunked_body_gives_its_events_whatever_the_chunks(sizes):
    raw = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(SSE, sizes) + b"garbage"
    code, headers, events = _read(raw)  # nothing after the last chunk is read
    assert code == 200 and headers["content-type"] == "text/event-stream"
    assert events == EVENTS


def test_content_length_and_close_delimited_bodies():
    assert _read(HEAD + b"Content-Length: %d\r\n\r\n" % len(SSE) + SSE + b"data: x\n\n")[2] \
        == EVENTS
    assert _read(HEAD + b"\r\n" + SSE)[2] == EVENTS


@pytest.mark.parametrize("raw,needle", [
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.1 status line"),
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "not a chunk size"),
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\n-1\r\n", "not a chunk size"),
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\n0x10\r\n", "not a chunk size"),
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\n10\r\nshort", "closed inside a chunk"),
    (HEAD + b"Content-Length: 1000\r\n\r\n" + SSE, "bytes before the body's end"),
    (HEAD + b"\r\ndata: [1]\n\n", "not a JSON object"),
    (HEAD + b"Content-Type", "closed in the middle of the response"),
])
def test_malformed_answers_are_protocol_errors(raw, needle):
    with pytest.raises(http1.ProtocolError, match=needle):
        _read(raw)


def test_error_text_of_a_refused_request():
    assert http1.error_text(b'{"error": "Exceeds maximum queue size"}') == \
        "Exceeds maximum queue size"
    assert http1.error_text(b'data: {"error": "bad max_tokens"}\n\n') == "bad max_tokens"
    assert http1.error_text(b"<html>502</html>") == "<html>502</html>"


def test_an_endless_line_or_event_is_refused_not_buffered():
    """A stream that never ends its line (or its event) stops the reader at the bound: its
    memory does not grow with the stream."""
    from moepipe.utils.sse import EventTooLarge

    parser = SSEParser(max_event_bytes=1000)
    parser.feed(b"data: " + b"x" * 900)
    with pytest.raises(EventTooLarge, match="line of over 1000 bytes"):
        for _ in range(10):
            parser.feed(b"x" * 100)
    parser = SSEParser(max_event_bytes=1000)
    with pytest.raises(EventTooLarge, match="event of over 1000 bytes"):
        for _ in range(20):
            parser.feed(b"data: " + b"y" * 90 + b"\n")
    # events under the bound, one after another, are fine however long the stream
    parser = SSEParser(max_event_bytes=1000)
    for _ in range(100):
        (event,) = parser.feed(b"data: " + b"z" * 900 + b"\n\n")
        assert len(event.data) == 900
