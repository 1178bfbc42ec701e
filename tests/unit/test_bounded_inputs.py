"""`moepipe balance` and the placement file take only what they can hold (issue 26, items 3
and 12): every read from a file or URL is bounded in size and time (utils/bounded.py), every
count and index is checked before it sizes a list, and everything else - devices, pickles,
invalid UTF-8, broken JSON, servers that do not speak HTTP or stop halfway - is one line and
exit 2 with no placement written. The servers are real sockets on 127.0.0.1."""

import json
import os
import pickle
import socket
import threading
import time

import pytest
import yaml

from moepipe.cli import main
from moepipe.errors import MoepipeError
from moepipe.utils.bounded import MiB, fetch_url

GOOD = "\n".join(f'moepipe_expert_tokens_total{{model="m",layer="{layer}",expert="{e}"}} '
                 f"{10 * (e + 1) + layer}" for layer in range(2) for e in range(4)) + "\n"


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    return exc.value.code, capsys.readouterr().err


def refused(capsys, tmp_path, *argv):
    """The one-line error of `moepipe balance ARGV --moe-ep 2`, with no placement written."""
    out = tmp_path / "placement.yaml"
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        main(["balance", *map(str, argv), "--moe-ep", "2", "--out", str(out)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert time.monotonic() - t0 < 20
    return lines[0]


class RawServer:
    """A TCP server on 127.0.0.1 that reads a request and lets ``handler(conn)`` answer."""

    def __init__(self, handler):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.handler, self.threads, self.stop = handler, [], threading.Event()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/metrics"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._answer, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _answer(self, conn):
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                self.handler(conn, self.stop)
            except OSError:  # the client gave up: what these servers are for
                pass

    def close(self):
        self.stop.set()
        self.sock.close()
        self.thread.join(5)
        for t in self.threads:
            t.join(10)


@pytest.fixture()
def server():
    made = []

    def start(handler):
        made.append(RawServer(handler))
        return made[-1].url
    yield start
    for s in made:
        s.close()


def sends(raw: bytes):
    def handler(conn, stop):
        conn.sendall(raw)
    return handler


def http(body: bytes, headers: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
            f"{headers}\r\n").encode() + body


# -- item 3: size and time ------------------------------------------------------------------

def test_counts_from_a_device_fifo_or_folder_are_refused_unread(tmp_path, capsys):
    assert "/dev/zero: is a character device" in refused(capsys, tmp_path, "--counts",
                                                         "/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    assert "is a named pipe" in refused(capsys, tmp_path, "--counts", fifo)
    fifo.unlink()
    # a folder is TensorRT-LLM's expert statistics (tests/unit/test_expert_statistic.py),
    # read only with the mapping of the deployment that wrote it
    assert "read as TensorRT-LLM's expert statistics" in refused(capsys, tmp_path, "--counts",
                                                               tmp_path)


def test_counts_file_larger_than_the_limit_is_refused_unread(tmp_path, capsys):
    big = tmp_path / "counts.txt"
    with open(big, "wb") as f:
        f.truncate(65 * MiB)  # sparse: no disk used
    msg = refused(capsys, tmp_path, "--counts", big)
    assert "65 MiB is larger than the 64 MiB moepipe reads of a counts file" in msg
    big.unlink()


def test_huge_metrics_body_is_refused_at_the_limit(server, tmp_path, capsys):
    def endless(conn, stop):  # no Content-Length: the body runs until the server closes
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        line = (GOOD.splitlines()[0] + "\n").encode() * 1000
        sent = 0
        while not stop.is_set() and sent < 800 * MiB:
            conn.sendall(line)
            sent += len(line)
    assert "answered more than the 64 MiB moepipe reads of a metrics page" in refused(
        capsys, tmp_path, "--metrics", server(endless))
    announced = http(b"", "").replace(b"Content-Length: 0", b"Content-Length: 800000000")
    assert "announces 762.9 MiB, more than the 64 MiB" in refused(
        capsys, tmp_path, "--metrics", server(sends(announced)))


def test_a_dripping_server_does_not_hold_balance(server, tmp_path, capsys, monkeypatch):
    """A byte every half second never trips a per-read timeout; the overall deadline does."""
    monkeypatch.setattr("moepipe.commands.plan.METRICS_TIMEOUT_S", 2.0)

    def drip(conn, stop):
        for byte in http(GOOD.encode()):
            if stop.is_set():
                return
            conn.sendall(bytes([byte]))
            time.sleep(0.5)
    t0 = time.monotonic()
    assert "no complete answer within 2 s" in refused(capsys, tmp_path, "--metrics",
                                                      server(drip))
    assert time.monotonic() - t0 < 6


def test_a_huge_expert_index_sizes_nothing(tmp_path, capsys):
    path = tmp_path / "metrics.txt"
    path.write_text(GOOD + 'moepipe_expert_tokens_total{model="m",layer="0",expert="50000000"}'
                           " 5\n")
    msg = refused(capsys, tmp_path, "--counts", path)
    assert f"{path}:9: expert label '50000000' is not an index in 0..16383" in msg


def test_a_placement_that_is_a_device_or_too_large_is_refused(tmp_path):
    from moepipe.trtllm.load_balancer import read_placement

    with pytest.raises(MoepipeError, match="/dev/zero: is a character device"):
        read_placement("/dev/zero", 2)
    big = tmp_path / "p.yaml"
    with open(big, "wb") as f:
        f.truncate(17 * MiB)
    with pytest.raises(MoepipeError, match="larger than the 16 MiB moepipe reads"):
        read_placement(big, 2)
    huge = tmp_path / "huge.yaml"  # one index of 10^12 would have built a set of 10^12
    huge.write_text(yaml.safe_dump({"moe_ep": 2, "load_balancer": {
        "num_slots": 4, "initial_global_assignments": {0: [0, 1, 2, 10**12]}}}))
    with pytest.raises(MoepipeError, match="does not place every expert"):
        read_placement(huge, 2)
    for layer in (-1, 10**12):
        bad = tmp_path / f"layer{layer}.yaml"
        bad.write_text(yaml.safe_dump({"moe_ep": 2, "load_balancer": {
            "num_slots": 4, "initial_global_assignments": {layer: [0, 1, 2, 3]}}}))
        with pytest.raises(MoepipeError, match="is not a decoder layer index"):
            read_placement(bad, 2)


# -- item 12: what balance reads ------------------------------------------------------------

def counts_file(tmp_path, content, name="counts.json"):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("content, says", [
    ('{"layers": {"0": [' + "9" * 400 + ", 1]}}", "99999999999999999999... is not a token "
                                                  "count"),
    ('{"layers": {"0": [' + "9" * 5000 + ", 1]}}", "not valid JSON"),
    ('{"layers": {"0": [NaN, 1]}}', "NaN is not a number JSON allows"),
    ('{"layers": {"0": [Infinity, 1]}}', "Infinity is not a number JSON allows"),
    ('{"layers": {"0": [1e400, 1]}}', "inf is not a token count"),
    ('{"layers": {"0": [-3, 1]}}', "-3 is not a token count"),
    ('{"layers": {"0": [true, 1]}}', "True is not a token count"),
    ('{"layers": {"0": ["7", 1]}}', "'7' is not a token count"),
    ('{"layers": {"-1": [1, 1]}}', "layer '-1' is not a layer index"),
    ('{"layers": {"1000000000000": [1, 1]}}', "layer '1000000000000' is not a layer index"),
    ('{"layers": {"0": 5}}', "layer 0 is not a list of 1..16384 counts"),
    ('{"layers": []}', "no layers"),
    ("[1, 2]", "not an expert-count file"),
    ('{"jobs": [{"job": "balance", "data": {"layer_expert": [[0.5, 0.5], [0.5, 0.5]], '
     '"layers": [{"tokens": 10}]}}]}', "do not have one row per layer"),
    ('{"jobs": [{"job": "balance", "data": {"layer_expert": [[0.5, "x"]], '
     '"layers": [{"tokens": 10}]}}]}', "layer 0 share 1: 'x' is not a token count"),
    ('{"jobs": 5}', "has no balance measurement"),
    ("moepipe_expert_tokens_total{layer=\"0\",expert=\"0\"} 1e5e5\n", ":1: '1e5e5' is not a "
                                                                       "token count"),
    ("moepipe_expert_tokens_total{layer=\"0\",expert=\"0\"} .\n", ":1: '.' is not a token"),
    ("moepipe_expert_tokens_total{layer=\"0\",expert=\"0\"} NaN\n", "'NaN' is not a token"),
    ("moepipe_expert_tokens_total{layer=\"0\",expert=\"0\"} +Inf\n", "'+Inf' is not a token"),
    ("moepipe_expert_tokens_total{layer=\"-1\",expert=\"0\"} 1\n", "layer label '-1' is not "
                                                                  "an index"),
    (GOOD + "moepipe_expert_tokens_total{layer=\"1000000000000\",expert=\"0\"} 1\n",
     "layer label '1000000000000' is not an index"),
    (b'{"layers": {"0": [1, 2]}, "x": "\xff"}', ":1: not UTF-8 text (byte 0xff)"),
    (pickle.dumps({"layers": {"0": [1, 2]}}), "is a Python pickle"),
    (b"PK\x03\x04torch", "is a zip archive"),
])
def test_bad_counts_are_refused_in_one_line(tmp_path, capsys, content, says):
    path = counts_file(tmp_path, content)
    assert says in refused(capsys, tmp_path, "--counts", path)


@pytest.mark.parametrize("answer, says", [
    (b"SSH-2.0-OpenSSH_9.6\r\n", "did not answer HTTP (BadStatusLine"),
    (b"HTTP/1.1 abc OK\r\n\r\n", "did not answer HTTP (BadStatusLine"),
    (b"", "did not answer HTTP (RemoteDisconnected"),
    (http(GOOD.encode())[:-40], "the answer stopped after"),
    (http(GOOD.encode(), "X-Big: " + "a" * 200_000 + "\r\n"), "did not answer HTTP "
                                                             "(LineTooLong"),
    (http(GOOD.encode(), "".join(f"X-{i}: {'a' * 50_000}\r\n" for i in range(4))),
     "answered 195.4 KiB of headers (more than 64 KiB)"),
    (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", "answered HTTP 404 Not Found"),
    (http(b"hello\n"), "no moepipe_expert_tokens_total samples"),
])
def test_metrics_servers_that_misbehave_are_one_line(server, tmp_path, capsys, answer, says):
    assert says in refused(capsys, tmp_path, "--metrics", server(sends(answer)))


def test_no_server_and_bad_urls_are_one_line(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert "cannot connect" in refused(capsys, tmp_path, "--metrics",
                                       f"http://127.0.0.1:{port}/metrics")
    assert "not a URL" in refused(capsys, tmp_path, "--metrics", "http://127.0.0.1:99999/")
    assert "not an http:// or https:// URL" in refused(capsys, tmp_path, "--metrics",
                                                       "ftp://127.0.0.1/metrics")


def test_a_good_server_still_gives_a_placement(server, tmp_path, capsys):
    out = tmp_path / "placement.yaml"
    url = server(sends(http(GOOD.encode())))
    chunked = server(sends(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                           + f"{len(GOOD):x}\r\n{GOOD}\r\n0\r\n\r\n".encode()))
    for source in (url, chunked):
        main(["balance", "--metrics", source, "--moe-ep", "2", "--out", str(out), "--json"])
        assert json.loads(capsys.readouterr().out)["moe_ep"] == 2
        placed = yaml.safe_load(out.read_text())["load_balancer"]["initial_global_assignments"]
        assert sorted(placed) == [0, 1]


def test_fetch_url_reads_within_its_limits(server):
    url = server(sends(http(b"x" * 1000)))
    assert fetch_url(url, 1000, 5) == b"x" * 1000
    with pytest.raises(MoepipeError, match="announces 1000 bytes, more than the 999 bytes"):
        fetch_url(url, 999, 5)


# -- item 3: the other files and answers moepipe reads --------------------------------------

def test_an_oversized_config_is_refused_unread(tmp_path):
    from moepipe.config import load_config

    path = tmp_path / "moepipe.yaml"
    with open(path, "wb") as f:
        f.truncate(17 * MiB)
    with pytest.raises(MoepipeError, match="17 MiB is larger than the 16 MiB moepipe reads"):
        load_config(path)


def test_a_calibration_set_is_read_only_as_far_as_needed(tmp_path):
    from moepipe.stages.quantize import CALIBRATION_BYTES_PER_TOKEN, _dataset_texts

    big = tmp_path / "corpus.txt"
    with open(big, "wb") as f:  # 8 GiB, sparse: reading it whole took 8 GiB of RAM
        f.truncate(8 << 30)
    t0 = time.monotonic()
    (text,) = _dataset_texts(big, "text", 40_000)
    assert len(text) == max(CALIBRATION_BYTES_PER_TOKEN * 40_000, MiB)
    assert time.monotonic() - t0 < 10
    lines = tmp_path / "corpus.jsonl"
    row = json.dumps({"text": "x" * 100}) + "\n"
    lines.write_text(row * 100_000)  # 10.9 MB; the cut-off last line is not parsed
    texts = _dataset_texts(lines, "text", 10)
    assert len(texts) == MiB // len(row) and texts[0] == "x" * 100


def test_validate_client_bounds_what_a_server_answers(server):
    from moepipe.validate.client import RESPONSE_LIMIT, ClientError, generate, generate_stream

    def flood(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        chunk = b"[" * MiB
        for _ in range(4 * RESPONSE_LIMIT // MiB):  # until the client hangs up
            if stop.is_set():
                return
            conn.sendall(chunk)
    base = server(flood).removesuffix("/metrics")
    with pytest.raises(ClientError, match="answered more than 64 MiB"):
        generate(base, "ensemble", {"text_input": "hi"}, timeout=20)
    with pytest.raises(ClientError, match="a line of more than 1 MiB in its event stream"):
        generate_stream(base, "ensemble", {"text_input": "hi"}, timeout=20)


def test_the_drain_reads_a_metrics_page_within_its_limit(server, monkeypatch):
    """`moepipe stop`'s drain watches the server's metrics page: bounded like every other
    read of it (a page past the limit is no answer, not a growing buffer)."""
    from moepipe.deploy.local import drain
    from moepipe.deploy.local.state import ServerState

    def state(url):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        return ServerState(pid=0, host="127.0.0.1", http_port=0, grpc_port=0, metrics_port=port,
                           repository="", log="", binary="", started=0.0)

    page = b"nv_inference_pending_request_count{model=\"a\"} 2\n" \
           b"nv_inference_pending_request_count{model=\"b\"} 3\n"
    assert drain.metrics(state(server(sends(http(page))))) == {
        "nv_inference_pending_request_count": 5.0}
    monkeypatch.setattr(drain, "METRICS_LIMIT", 64)
    assert drain.metrics(state(server(sends(http(page))))) is None
