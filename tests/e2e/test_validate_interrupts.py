"""Issue 26 items 7, 8 and 9 through the CLI: validate's load workers end with it on SIGTERM
and Ctrl-C (one line, 143 / 130, no BrokenPipe traceback); an endpoint that answers binary
garbage or nothing at all fails validate in seconds with one line and a well-formed JUnit
report."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

WORKER = "moepipe.validate.load"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", WORKER], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _config(folder: Path, **validate) -> Path:
    data = {"model": {"example": "tiny-mixtral"}, "parallel": {"tp": 2, "moe_ep": 2},
            "build": {"max_batch_size": 16, "max_input_len": 256, "max_seq_len": 512},
            "validate": validate, "workdir": str(folder / "work")}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "moepipe.yaml").write_text(yaml.safe_dump(data))
    return folder / "moepipe.yaml"


def _default_signals():
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_validate_stops_its_load_workers_first(deployment, tmp_path, how):
    _, ep = deployment
    config = _config(tmp_path, jobs=["perf"],
                     load={"processes": 2, "max_tokens": 8},
                     perf={"concurrency": [4], "rates": [], "requests": 100000,
                           "duration_s": 300})
    # Its own session: Ctrl-C in a terminal signals the whole foreground process group.
    proc = subprocess.Popen([sys.executable, "-m", "moepipe", "validate", "-c", str(config),
                             "--url", ep.http, "--grpc-url", ep.grpc],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_signals)
    try:
        deadline = time.monotonic() + 120
        while len(workers := _children(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(5)  # they send load now
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == (143 if how == "sigterm" else 130)
    assert err.splitlines() == ["interrupted by SIGTERM" if how == "sigterm" else "interrupted"]
    assert not [w for w in workers if _alive(w)], "a load worker outlived validate"
    time.sleep(2)  # a worker that had lived on would have written by now (BrokenPipe)
    assert "Traceback" not in err and "BrokenPipe" not in err


class _Garbage(BaseHTTPRequestHandler):
    """A server that answers everything with an error message of binary garbage."""

    def _answer(self):
        body = json.dumps({"error": "".join(map(chr, range(32))) + "\ud800\uffff garbage"})
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def _validate(config, url):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "moepipe", "validate", "-c", str(config),
                           "--url", url, "--grpc-url", url], capture_output=True, text=True,
                          timeout=300)
    return proc, time.monotonic() - started


def test_validate_of_a_server_answering_garbage_fails_fast_with_a_well_formed_report(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"127.0.0.1:{server.server_address[1]}"
        config = _config(tmp_path, jobs=["smoke", "accuracy"])
        proc, _ = _validate(config, url)
    finally:
        server.shutdown()
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: the endpoint does not answer (http {url}, http_ready): "
                           "ClientError: \\x00\\x01\\x02")
    assert "no job was run" in line
    root = ET.parse(tmp_path / "work" / "reports" / "validate.junit.xml").getroot()
    assert root.get("errors") == "1"
    assert root.find("testsuite").get("name") == "endpoint"
    assert "\\x00" in root.find("testsuite/testcase/error").get("message")


def test_validate_of_a_black_holed_endpoint_fails_in_seconds(tmp_path):
    """Not 120 s per check (validate.timeout_s); and `validate.max_tokens` far above what the
    build serves is refused before anything runs."""
    too_many = _config(tmp_path / "a", max_tokens=100_000)
    proc, _ = _validate(too_many, "127.0.0.1:1")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert "validate.max_tokens is 100000; the build serves at most 511" in proc.stderr

    with socket.socket() as hole:  # accepts connections (backlog), never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        url = f"127.0.0.1:{hole.getsockname()[1]}"
        proc, took = _validate(_config(tmp_path / "b", jobs=["smoke", "accuracy"]), url)
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: the endpoint does not answer (http {url}, http_ready): ")
    assert "timed out" in line
    print(f"\nblack-holed endpoint: validate failed after {took:.1f}s")
