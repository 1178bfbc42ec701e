"""Unix-domain sockets at any path, one JSON object per line.

A socket's path is limited to 107 bytes (``sun_path``); deployment folders can be deeper. The
socket is bound (and reached) through ``/proc/self/fd/<fd of its folder>/<name>``, which is
short and names the same place (Linux). The socket file is made readable and writable by its
owner only: whoever may use it may change what the server serves.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

LINE_LIMIT = 1 << 20  # one request or answer


@contextlib.contextmanager
def _short(path: Path) -> Iterator[str]:
    """A path of at most ~40 bytes naming ``path`` while the context lasts."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def listen(path: Path) -> socket.socket:
    """A listening socket at ``path`` (owner only); a stale socket file there is replaced,
    a live one (another server answers on it) is an OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        try:
            connect(path, timeout=1.0).close()
        except OSError:
            path.unlink(missing_ok=True)  # nobody listens: left by a process that died
        else:
            raise OSError(f"{path}: another process is listening on it")
    old = os.umask(0o177)  # created 0600
    try:
        sock = _opened(path, socket.socket.bind)
    finally:
        os.umask(old)
    sock.listen(4)
    return sock


def connect(path: Path, timeout: float) -> socket.socket:
    """A connection to the socket at ``path`` (OSError when nobody listens)."""
    def reach(sock: socket.socket, short: str) -> None:
        sock.settimeout(timeout)
        sock.connect(short)

    return _opened(path, reach)


def _opened(path: Path, use: Callable[[socket.socket, str], None]) -> socket.socket:
    """A new socket that ``use`` bound or connected to ``path`` (closed if that fails)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short(path) as short:
            use(sock, short)
    except OSError:
        sock.close()
        raise
    return sock


def send(sock: socket.socket, obj: Any) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def receive(sock: socket.socket) -> Any:
    """The next JSON line from ``sock`` (ConnectionError when it closes first, ValueError
    for a line that is too long or not JSON)."""
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        buf += chunk
        if len(buf) > LINE_LIMIT:
            raise ValueError(f"a line of more than {LINE_LIMIT} bytes")
    return json.loads(buf)
