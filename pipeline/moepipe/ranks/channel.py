"""The control channel between the leader and one worker: a TCP connection carrying frames
(one kind byte, a length, the payload). The leader sends step descriptions and commands; the
worker sends its hello, the timings of each step and heartbeats. JSON for what is small and
rare, raw little-endian int64 / float64 arrays for what goes with every step.

The connection is also the group's health channel: a worker that dies (even by SIGKILL) closes
it, which the leader's monitor sees at once; a worker that stops sending heartbeats for
:data:`HEARTBEAT_TIMEOUT_S` (a hung process, an unreachable host) counts as lost too.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from enum import IntEnum
from typing import Any

HEADER = struct.Struct("<BI")
HEARTBEAT_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.0
MAX_FRAME = 1 << 30


class Kind(IntEnum):
    HELLO = 1  # worker -> leader, JSON: rank, pid, host
    SETUP = 2  # leader -> worker, JSON: generation, world size, store port, settings
    STEP = 3  # leader -> worker, int64 array (moepipe.ranks.steps)
    TIMING = 4  # worker -> leader, JSON: one step's timings (and expert counts)
    BEAT = 5  # worker -> leader, empty: still alive
    REFUSED = 6  # leader -> worker, JSON: why the leader will not take it (a duplicate rank)
    STAGED = 7  # worker -> leader, JSON: a weights version loaded (or why not)


class ChannelClosed(ConnectionError):
    """The other end closed the connection (or it broke)."""


class Channel:
    """One end of a control connection. ``send`` may be called from several threads."""

    def __init__(self, sock: socket.socket):
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # a step is one small frame
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()

    @classmethod
    def connect(cls, host: str, port: int, timeout: float) -> Channel:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        return cls(sock)

    @property
    def local_address(self) -> str:
        return str(self.sock.getsockname()[0])

    def send(self, kind: Kind, payload: bytes = b"") -> None:
        try:
            with self._send_lock:
                self.sock.sendall(HEADER.pack(kind, len(payload)) + payload)
        except OSError as e:
            raise ChannelClosed(str(e)) from None

    def send_json(self, kind: Kind, obj: Any) -> None:
        self.send(kind, json.dumps(obj).encode())

    def recv(self) -> tuple[Kind, bytes]:
        kind, size = HEADER.unpack(self._exactly(HEADER.size))
        if size > MAX_FRAME:
            raise ChannelClosed(f"a frame of {size} bytes: not a moepipe rank channel")
        return Kind(kind), self._exactly(size)

    def recv_json(self, expect: Kind) -> Any:
        kind, payload = self.recv()
        if kind == Kind.REFUSED and expect != Kind.REFUSED:
            raise ChannelClosed(json.loads(payload).get("why", "refused by the leader"))
        if kind != expect:
            raise ChannelClosed(f"expected {expect.name}, got {kind.name}")
        return json.loads(payload)

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except (OSError, ValueError) as e:  # ValueError: closed by another thread
                raise ChannelClosed(str(e)) from None
            if not chunk:
                raise ChannelClosed("connection closed by the other end")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
