"""Split each client's TTFT at the wire: a packet capture of a loadgen_bench run, per request.

    tcpdump -i lo -n -s 600 -w /tmp/cap.pcap tcp &      # as root, while the benchmark runs
    python benchmarks/loadgen_bench.py --aiperf <venv>/bin/aiperf --rates '' --concurrency 1 \\
        --repeat 1
    kill %1
    python benchmarks/ttft_capture.py /tmp/cap.pcap <the benchmark's workdir> concurrency-1-0

For every HTTP connection to the server (the one that received ``POST .../generate_stream``;
the clients told apart by their request bodies: only the driver asks for
``return_num_output_tokens``): its SYN, its request segment and the server's first segment
whose ``text_output`` is not empty. Each client's own per-request stamps (AIPerf's
``profile_export.jsonl``: wall-clock ``request_start_ns``, ``http_req_sending``,
``time_to_first_token``; the driver's samples: ``sent``, ``wrote``, ``first`` on its wall-clock
``t0_wall``) are matched to the connection whose SYN follows the request's start. Printed per
client: start to SYN, SYN to the request on the wire, the request's write stamp to the wire,
the server (request segment to first text segment) and that segment to the client's stamp.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
from pathlib import Path

import numpy as np

TEXT = re.compile(rb'"text_output":"((?:[^"\\]|\\.)*)"')


def read_pcap(path: Path) -> dict[tuple[int, int], list[tuple[float, int, bytes]]]:
    """(source port, destination port) -> [(time, TCP flags, payload)] of the IPv4 TCP
    packets of a classic pcap file (Ethernet, Linux cooked or loopback link types)."""
    raw = path.read_bytes()
    if len(raw) < 24:
        raise SystemExit(f"error: {path} is not a pcap file (hint: tcpdump -w writes one)")
    magic = struct.unpack("<I", raw[:4])[0]
    if magic not in (0xA1B2C3D4, 0xA1B23C4D):
        raise SystemExit(f"error: {path} is not a little-endian classic pcap file "
                         "(hint: tcpdump -w, not pcapng)")
    scale = 1e9 if magic == 0xA1B23C4D else 1e6
    link = struct.unpack("<I", raw[20:24])[0]
    header = {1: 14, 113: 16}.get(link, 4)
    conns: dict[tuple[int, int], list[tuple[float, int, bytes]]] = {}
    off = 24
    while off + 16 <= len(raw):
        sec, frac, incl, _ = struct.unpack("<IIII", raw[off:off + 16])
        ip = raw[off + 16 + header: off + 16 + incl]
        off += 16 + incl
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        ihl, total = (ip[0] & 15) * 4, struct.unpack(">H", ip[2:4])[0]
        tcp = ip[ihl:]
        sport, dport = struct.unpack(">HH", tcp[:4])
        conns.setdefault((sport, dport), []).append(
            (sec + frac / scale, tcp[13], tcp[(tcp[12] >> 4) * 4: total - ihl]))
    return conns


def connections(conns: dict) -> list[dict]:
    """Per HTTP connection: who sent it, its SYN, request and first text segment times."""
    port = next((dp for (_, dp), pk in conns.items()
                 if any(pl.startswith(b"POST /v2/models/") for _, _, pl in pk)), None)
    if port is None:
        raise SystemExit("error: no HTTP request to /v2/models/ in the capture (hint: capture "
                         "with -s 600 on lo while the benchmark runs)")
    out = []
    for (sp, dp), pk in conns.items():
        sent = [(t, pl) for t, _, pl in pk if pl]
        if dp != port or not sent:
            continue
        first = None
        for t, _, pl in conns.get((dp, sp), []):
            if any(m.group(1) for m in TEXT.finditer(pl)):
                first = t
                break
        body = b"".join(pl for _, pl in sent)
        out.append({"who": "driver" if b"return_num_output_tokens" in body else "aiperf",
                    "syn": next((t for t, f, _ in pk if f & 2), None), "request": sent[0][0],
                    "text": first})
    return out


def client_stamps(work: Path, tag: str) -> dict[str, list[dict]]:
    """Both clients' per-request wall-clock stamps (start, request written, first token)."""
    aiperf = []
    for line in (work / f"aiperf-{tag}" / "profile_export.jsonl").read_text().splitlines():
        record = json.loads(line)
        meta = record["metadata"]
        if meta.get("benchmark_phase") != "profiling":
            continue
        m = {k: v["value"] for k, v in record["metrics"].items()}
        start = meta["request_start_ns"] / 1e9
        aiperf.append({"start": start, "wrote": start + m["http_req_sending"] / 1e3,
                       "first": start + m["time_to_first_token"] / 1e3})
    lo, hi = min(r["start"] for r in aiperf), max(r["start"] for r in aiperf)
    run = json.loads((work / f"driver-http-{tag}.json").read_text())
    t0 = run["t0_wall"]
    driver = [{"start": t0 + s["sent"], "wrote": t0 + s["wrote"], "first": t0 + s["first"]}
              for s in run["samples"] if s["status"] == "ok" and s.get("wrote") is not None
              and lo <= t0 + s["sent"] <= hi]
    return {"driver": driver, "aiperf": aiperf}


def split(stamps: list[dict], conns: list[dict]) -> tuple[dict[str, list[float]], int]:
    """Per request (ms): the parts of its TTFT; and how many requests had no connection."""
    ours = sorted((c for c in conns if c["syn"] and c["text"]), key=lambda c: c["syn"])
    syns = np.array([c["syn"] for c in ours])
    parts: dict[str, list[float]] = {
        "start to SYN": [], "SYN to request on the wire": [], "write stamp to the wire": [],
        "server: request to first text segment": [], "that segment to the client's stamp": [],
        "TTFT (the client's)": []}
    missed = 0
    for r in stamps:
        i = int(np.searchsorted(syns, r["start"]))
        if i >= len(ours) or ours[i]["syn"] - r["start"] > 0.05:
            missed += 1
            continue
        c = ours[i]
        for name, a, b in (("start to SYN", r["start"], c["syn"]),
                           ("SYN to request on the wire", c["syn"], c["request"]),
                           ("write stamp to the wire", r["wrote"], c["request"]),
                           ("server: request to first text segment", c["request"], c["text"]),
                           ("that segment to the client's stamp", c["text"], r["first"]),
                           ("TTFT (the client's)", r["start"], r["first"])):
            parts[name].append(1000 * (b - a))
    return parts, missed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pcap", type=Path)
    ap.add_argument("workdir", type=Path, help="the benchmark's workdir (it prints it)")
    ap.add_argument("tag", help="point and repeat, e.g. concurrency-1-0 or rate-2-1")
    args = ap.parse_args()
    conns = connections(read_pcap(args.pcap))
    for who, stamps in client_stamps(args.workdir, args.tag).items():
        parts, missed = split(stamps, [c for c in conns if c["who"] == who])
        print(f"{who}: {len(stamps)} requests, {missed} without a matching connection")
        for name, values in parts.items():
            if values:
                v = np.array(values)
                print(f"  {name:<40} p50 {np.percentile(v, 50):7.3f}  p90 "
                      f"{np.percentile(v, 90):7.3f}  p99 {np.percentile(v, 99):7.3f} ms")


if __name__ == "__main__":
    main()
