"""The Locust file every deployment ships, run headless by Locust itself against the shared cpu
deployment on 127.0.0.1: both users (HTTP generate_stream, gRPC stream) send requests without a
failure, report time to first token below the whole request, count the server's tokens, and
the run stops by itself."""

import csv
import subprocess
import sys
import time
from pathlib import Path

from moepipe.utils import sse


def test_shipped_locust_file_runs_headless_against_the_deployment(deployment, tmp_path):
    cfg, ep = deployment
    folder = cfg.deploy_dir / "locust"
    assert sorted(p.name for p in folder.iterdir()) == ["locust.conf", "locustfile.py",
                                                         "prompts.json", "sse_events.py"]
    assert (folder / "sse_events.py").read_text() == Path(sse.__file__).read_text()
    conf = (folder / "locust.conf").read_text()
    assert f"host = http://{ep.http}\n" in conf and f"grpc-host = {ep.grpc}\n" in conf
    assert ep.http.startswith("127.0.0.1:") and ep.grpc.startswith("127.0.0.1:")
    locust = Path(sys.executable).parent / "locust"
    started = time.monotonic()
    run = subprocess.run([str(locust), "--headless", "-u", "2", "-r", "2", "--run-time", "8s",
                          "--csv", str(tmp_path / "stats"), "--only-summary",
                          "--max-tokens", "8"], cwd=folder, capture_output=True, text=True,
                         timeout=180)  # locust.conf and locustfile.py from the folder
    took = time.monotonic() - started
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert took < 90  # it stopped by itself after its run time
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(
        (tmp_path / "stats_stats.csv").open())}
    for kind, name in (("HTTP", "generate_stream"), ("gRPC", "ModelStreamInfer")):
        whole, first = rows[(kind, name)], rows[(kind, f"{name} TTFT")]
        assert int(whole["Request Count"]) >= 2 and int(whole["Failure Count"]) == 0, whole
        # (a request the end of the run cut off may have had its first token)
        assert 0 <= int(first["Request Count"]) - int(whole["Request Count"]) <= 1
        assert float(first["Median Response Time"]) < float(whole["Median Response Time"])
        # the size column counts the server's output tokens (max_tokens 8 unless it sampled
        # the end id early)
        assert 4 <= float(whole["Average Content Size"]) <= 8, whole
