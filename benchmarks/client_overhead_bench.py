"""Each HTTP client's own share of TTFT: AIPerf's request path against moepipe's driver, no server.

    <aiperf venv>/bin/python benchmarks/client_overhead_bench.py [--requests 300]

A loopback server (asyncio, in this process) reads the whole request, waits ``--delay-ms``
(5) and sends one server-sent event with text: TTFT minus that delay is what the client itself
adds (connect, write, read, parse). AIPerf's path is the one its worker runs for
``--connection-reuse-strategy never`` (aiperf/transports/aiohttp_transport.py
``send_request``: a new ``create_tcp_connector(force_close=True, limit=1)`` per request, then
``AioHttpClient.post_request``), its TTFT the same as its TTFT metric: first SSE message's
``perf_ns`` minus the record's ``start_perf_ns``. The driver's is ``_HttpClient.send``
(``first - sent``). The two alternate, one request at a time, so both see the same machine.
Runs in AIPerf's virtualenv (it imports aiperf) with moepipe taken from this checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))

from moepipe.validate import load as driver  # noqa: E402

BODY = b'{"text_input": "hello", "max_tokens": 64, "stream": true}'


def serve(delay_s: float):
    """A connection handler: the whole request, ``delay_s``, one SSE event with text."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        await asyncio.sleep(delay_s)
        event = b"data: " + json.dumps({"text_output": "hi", "num_output_tokens": 1}).encode()
        chunk = event + b"\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()
    return handle


async def measure(requests: int, delay_s: float) -> dict[str, list[float]]:
    """Per request (ms): each client's TTFT and the time until its request was written."""
    from aiperf.transports.aiohttp_client import AioHttpClient, create_tcp_connector

    server = await asyncio.start_server(serve(delay_s), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ours = driver._HttpClient(f"127.0.0.1:{port}", "ensemble", 10.0, time.monotonic())
    theirs = AioHttpClient(timeout=10.0)
    url = f"http://127.0.0.1:{port}/v2/models/ensemble/generate_stream"
    out: dict[str, list[float]] = {"driver TTFT": [], "AIPerf TTFT": [],
                                   "driver request written after": [],
                                   "AIPerf request written after": []}
    async with server:
        for _ in range(requests):
            s = await ours.send(driver.Prompt("short", "hello", 64))
            if s.status != "ok" or s.first is None or s.wrote is None:
                raise SystemExit(f"error: the driver's request failed: {s.error}")
            out["driver TTFT"].append(1000 * (s.first - s.sent))
            out["driver request written after"].append(1000 * (s.wrote - s.sent))
            connector = create_tcp_connector(force_close=True, limit=1, keepalive_timeout=None)
            r = await theirs.post_request(url, BODY, {"Content-Type": "application/json"},
                                          connector=connector, connector_owner=True)
            if r.error is not None or not r.responses:
                raise SystemExit(f"error: AIPerf's request failed: {r.error}")
            out["AIPerf TTFT"].append((r.responses[0].perf_ns - r.start_perf_ns) / 1e6)
            out["AIPerf request written after"].append(
                (r.trace_data.request_send_end_perf_ns - r.start_perf_ns) / 1e6)
    await theirs.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    args = ap.parse_args()
    try:
        import aiperf  # noqa: F401
    except ImportError:
        sys.exit("error: AIPerf is not importable here (hint: run this with the python of "
                 "AIPerf's virtualenv, e.g. /tmp/aiperf-venv/bin/python)")
    out = asyncio.run(measure(args.requests, args.delay_ms / 1000))
    print(f"{args.requests} requests per client, alternating; the server answers after "
          f"{args.delay_ms:g} ms")
    for name, values in out.items():
        v = np.array(values)
        print(f"  {name:<30} p50 {np.percentile(v, 50):6.3f}  p90 {np.percentile(v, 90):6.3f}  "
              f"p99 {np.percentile(v, 99):6.3f} ms")


if __name__ == "__main__":
    main()
