"""Reads with limits: every file or URL moepipe reads because a user named it goes through here.

A file is read only when it is a regular file (``/dev/zero``, a named pipe or a folder are
refused before a byte is read: a pipe would block, a device never ends) and only up to a size
limit; a URL is read up to a size limit within one overall deadline (a server that drips a
byte every few seconds never trips a per-read timeout, so every read gets only the time left
of the whole fetch), and whatever it answers that is not a complete HTTP response - another
protocol, a bad status line, a short body, huge headers - is one error naming the URL. JSON
and UTF-8 are decoded with errors that name the file and where in it.
"""

from __future__ import annotations

import http.client
import io
import json
import math
import os
import socket
import stat
import time
import urllib.parse
from typing import Any

from moepipe.errors import MoepipeError

KiB, MiB = 1 << 10, 1 << 20
# Response headers moepipe accepts in total (http.client itself allows 100 lines of 64 KiB).
HEADER_LIMIT = 64 * KiB

# What the first bytes of a file say it is, for files moepipe never loads (a pickle runs code
# when loaded; torch.save writes a zip holding one).
_PICKLE = tuple(bytes([0x80, proto]) for proto in range(2, 6))
_ZIP = b"PK\x03\x04"


class ReadError(MoepipeError):
    """A file or URL that cannot be read within moepipe's limits, or is not what was asked."""


def size_text(n: int) -> str:
    """``n`` bytes for a message: 64 MiB, 512 KiB, 100 bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} bytes"


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for messages (``a named pipe``)."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_file(path: os.PathLike | str, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; a ReadError naming
    the path for anything else (missing, unreadable, not a regular file, too large)."""
    return _read(path, limit, what, prefix=False)[0]


def read_prefix(path: os.PathLike | str, limit: int, what: str = "file"
                ) -> tuple[bytes, bool]:
    """(the first ``limit`` bytes of the regular file ``path``, whether that is all of it):
    for inputs of which moepipe needs only a part (a calibration set of any size)."""
    return _read(path, limit, what, prefix=True)


def _read(path: os.PathLike | str, limit: int, what: str, prefix: bool) -> tuple[bytes, bool]:
    hint = f"give moepipe a regular {what} of at most {size_text(limit)}"
    try:
        # O_NONBLOCK: opening a named pipe does not wait for a writer; fstat decides below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise ReadError(f"{path}: cannot read ({e.strerror})", hint) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReadError(f"{path}: is {file_kind(st.st_mode)}, not a regular file", hint)
        if st.st_size > limit and not prefix:
            raise ReadError(f"{path}: {size_text(st.st_size)} is larger than the "
                            f"{size_text(limit)} moepipe reads of a {what}", hint)
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= limit:  # the size may have changed since fstat: read one byte more
            chunk = os.read(fd, min(MiB, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise ReadError(f"{path}: cannot read ({e.strerror})", hint) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if total > limit and not prefix:
        raise ReadError(f"{path}: larger than the {size_text(limit)} moepipe reads of a {what}",
                        hint)
    return data[:limit], total <= limit


def refuse_pickle(raw: bytes, where: str) -> None:
    """Refuse a Python pickle (or a torch.save zip) by its first bytes: moepipe never loads
    them (unpickling runs code)."""
    if raw.startswith(_PICKLE):
        raise ReadError(f"{where}: is a Python pickle; moepipe does not load pickles "
                        "(loading one runs code)", "save the data as JSON or text")
    if raw.startswith(_ZIP):
        raise ReadError(f"{where}: is a zip archive (torch.save writes pickles in one); "
                        "moepipe does not load pickles", "save the data as JSON or text")


def decode_utf8(raw: bytes, where: str) -> str:
    """``raw`` as UTF-8 text; not UTF-8 is a ReadError naming the line and the byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ReadError(f"{where}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x})",
                        "save the file as UTF-8") from None


def read_text(path: os.PathLike | str, limit: int, what: str = "file") -> str:
    """A UTF-8 text file of at most ``limit`` bytes (see :func:`read_file`)."""
    return decode_utf8(read_file(path, limit, what), str(path))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def loads_json(text: str | bytes, where: str, *, allow_nan: bool = True) -> Any:
    """Parsed JSON; anything that is not (bad syntax, nesting deeper than Python recurses, an
    integer of more digits than Python converts, NaN or Infinity when not ``allow_nan``) is a
    ReadError naming ``where``."""
    try:
        if isinstance(text, bytes):
            text = decode_utf8(text, where)
        return json.loads(text, parse_constant=None if allow_nan else _no_constant)
    except RecursionError:
        raise ReadError(f"{where}: JSON nested too deeply", "is this the right file?") from None
    except ValueError as e:  # JSONDecodeError, int digit limit, NaN refused
        raise ReadError(f"{where}: not valid JSON ({e})", "is this the right file?") from None


# -- URLs ------------------------------------------------------------------------------------

class _Deadline(io.RawIOBase):
    """The response side of a socket: each read waits only for what is left of the deadline
    and the bytes are counted (headers and body together)."""

    def __init__(self, sock: socket.socket, deadline: float, cap: int):
        self.sock, self.deadline, self.cap, self.total = sock, deadline, cap, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(left)
        n = self.sock.recv_into(buf)
        self.total += n
        if self.total > self.cap:
            raise _TooLarge
        return n


class _TooLarge(Exception):
    pass


class _DeadlineSocket:
    """What http.client needs of a socket (sendall, makefile, close), under one deadline."""

    def __init__(self, sock: socket.socket, deadline: float, cap: int):
        self.sock, self.deadline, self.cap = sock, deadline, cap

    def sendall(self, data: bytes) -> None:
        self.sock.settimeout(max(self.deadline - time.monotonic(), 1e-3))
        self.sock.sendall(data)

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        return io.BufferedReader(_Deadline(self.sock, self.deadline, self.cap))

    def close(self) -> None:
        """http.client closes the connection as soon as it has the response of a
        ``Connection: close`` request (a real socket lives on in its makefile);
        :func:`fetch_url` closes the socket when it has read the body."""


def fetch_url(url: str, limit: int, timeout_s: float, what: str = "page") -> bytes:
    """The body of ``GET url`` (``http://`` assumed without a scheme): at most ``limit``
    bytes, all of it within ``timeout_s`` seconds. Anything else - no server, not HTTP, a
    status other than 200, a short or oversized answer, too slow - is a ReadError naming the
    URL."""
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise ReadError(f"{url}: not a URL ({e})", "for example http://127.0.0.1:8002/metrics") \
            from None
    if parts.scheme not in ("http", "https") or not host:
        raise ReadError(f"{url}: not an http:// or https:// URL",
                        "for example http://127.0.0.1:8002/metrics")
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(host, port, timeout=timeout_s)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query

    def fail(why: str) -> ReadError:
        return ReadError(f"{url}: {why}", f"is this the {what} of a running server?")

    sock = None
    try:
        conn.connect()
        sock = conn.sock
        conn.sock = _DeadlineSocket(sock, deadline, limit + HEADER_LIMIT)
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        header_bytes = sum(len(k) + len(v) + 4 for k, v in resp.getheaders())
        if header_bytes > HEADER_LIMIT:
            raise fail(f"answered {size_text(header_bytes)} of headers (more than "
                       f"{size_text(HEADER_LIMIT)})")
        if resp.status != 200:
            raise fail(f"answered HTTP {resp.status} {resp.reason}")
        if resp.length is not None:  # Content-Length: read() refuses a short body
            if resp.length > limit:
                raise fail(f"announces {size_text(resp.length)}, more than the "
                           f"{size_text(limit)} moepipe reads of a {what}")
            body = resp.read()
        else:  # chunked or until the server closes
            body = resp.read(limit + 1)
            if len(body) > limit:
                raise _TooLarge
        return body
    except _TooLarge:
        raise fail(f"answered more than the {size_text(limit)} moepipe reads of a "
                   f"{what}") from None
    except TimeoutError:  # socket.timeout is TimeoutError
        raise fail(f"no complete answer within {timeout_s:g} s") from None
    except http.client.IncompleteRead as e:
        raise fail(f"the answer stopped after {len(e.partial)} bytes of the body") from None
    except (http.client.HTTPException, ConnectionResetError) as e:
        raise fail(f"did not answer HTTP ({type(e).__name__}: {str(e)[:80]!r})") from None
    except OSError as e:
        raise fail(f"cannot connect ({e.strerror or e})") from None
    finally:
        conn.close()
        if sock is not None:
            sock.close()
