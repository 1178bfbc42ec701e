"""A real server's ``generate_stream`` answer, re-chunked: the load driver's HTTP reader and the
smoke job's client give the same responses and token counts through a proxy that splits the
events into single bytes, random pieces, or one piece holding them all; and the stream's events
parse the same with other line endings, comments and pieces (issue 25, item 7)."""

import asyncio
import json
import random
import socket
import threading

import pytest

from moepipe.utils.sse import SSEParser
from moepipe.validate import client, http1
from moepipe.validate.load import LoadPlan, Prompt, run_load

PROMPT = {"text_input": "It was the best of times", "max_tokens": 10, "stream": True,
          "return_num_output_tokens": True}


def _raw_answer(http: str) -> tuple[int, dict, bytes]:
    """Status, headers and the de-chunked body of one generate_stream request, read raw."""
    host, port = http.rsplit(":", 1)

    async def go():
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps(PROMPT).encode()
        writer.write(b"POST /v2/models/ensemble/generate_stream HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        code, headers = await http1.read_head(reader)
        whole = await http1.read_body(reader, headers)
        writer.close()
        return code, headers, whole
    return asyncio.run(go())


class Rechunker:
    """A loopback HTTP proxy that passes requests through and re-frames each answer's body in
    chunks of its own: ``bytes`` (one byte each), ``random`` (1-13 bytes, seeded) or ``whole``
    (everything in one chunk at the end)."""

    def __init__(self, upstream: str, mode: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream, self.mode, self.rng = (host, int(port)), mode, random.Random(25)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"127.0.0.1:{sock.getsockname()[1]}"
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)

    def __enter__(self):
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _serve(self, sock):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._relay, sock=sock))
        self.ready.set()
        self.loop.run_forever()

    def _sizes(self, n: int):
        if self.mode == "bytes":
            return [1] * n
        sizes = []
        while sum(sizes) < n:
            sizes.append(self.rng.randint(1, 13))
        return sizes

    async def _relay(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        up_writer.write(head + await reader.readexactly(length))
        code, headers = await http1.read_head(up_reader)
        writer.write(b"HTTP/1.1 %d Relayed\r\n" % code + b"".join(
            f"{k}: {v}\r\n".encode() for k, v in headers.items()
            if k not in ("content-length", "transfer-encoding"))
            + b"Transfer-Encoding: chunked\r\n\r\n")
        held = b""
        async for piece in http1.body(up_reader, headers):
            held += piece
            if self.mode == "whole":
                continue
            at = 0
            for size in self._sizes(len(held)):
                if at + size > len(held):
                    break
                writer.write(b"%x\r\n" % size + held[at:at + size] + b"\r\n")
                await writer.drain()
                at += size
            held = held[at:]
        if held:
            writer.write(b"%x\r\n" % len(held) + held + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        up_writer.close()
        writer.close()


def test_the_streams_events_parse_the_same_with_other_line_endings_comments_and_pieces(
        deployment):
    _, ep = deployment
    code, headers, body = _raw_answer(ep.http)
    assert code == 200 and "chunked" in headers.get("transfer-encoding", "")
    parser = SSEParser()
    events = [e.data for e in parser.feed(body) + parser.close()]
    assert len(events) >= 2 and all("text_output" in json.loads(e) for e in events)
    variants = {"crlf": body.replace(b"\n", b"\r\n"), "cr": body.replace(b"\n", b"\r"),
                "comments": body.replace(b"\n\n", b"\n: keep-alive\n\n:\n"),
                "no space": body.replace(b"data: ", b"data:")}
    rng = random.Random(7)
    for name, stream in variants.items():
        for _ in range(20):
            cuts = sorted(rng.sample(range(len(stream)), min(len(stream), rng.randint(1, 40))))
            parser, got, last = SSEParser(), [], 0
            for cut in [*cuts, len(stream)]:
                got += [e.data for e in parser.feed(stream[last:cut])]
                last = cut
            assert got + [e.data for e in parser.close()] == events, name


@pytest.mark.parametrize("mode", ["bytes", "random", "whole"])
def test_load_driver_and_client_read_a_rechunked_stream_as_the_server_sent_it(deployment,
                                                                               mode):
    _, ep = deployment
    prompts = [Prompt("short", p, 10) for p in ("It was the best of times",
                                                "A Lion lay asleep in the forest")]

    def run(url):
        res = run_load(LoadPlan(url=url, prompts=prompts, concurrency=1, max_requests=4,
                                duration_s=60, timeout_s=60, protocol="http"))
        return [(s.status, s.error, s.kind, s.responses, s.tokens) for s in res.samples]

    direct = run(ep.http)
    assert [s[0] for s in direct] == ["ok"] * 4 and all(s[4] > 0 for s in direct), direct
    with Rechunker(ep.http, mode) as proxy:
        assert run(proxy.url) == direct
        payload = {k: v for k, v in PROMPT.items() if k != "stream"}
        assert client.generate_stream(proxy.url, "ensemble", payload) == \
            client.generate_stream(ep.http, "ensemble", payload)
