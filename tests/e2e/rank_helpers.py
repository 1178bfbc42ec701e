"""Starting a rank group's workers for a test (the leader is the test process), and making
sure none outlives the test."""

import contextlib
import subprocess
import sys

from helpers import free_ports


@contextlib.contextmanager
def workers(checkpoint, world_size, port=None, log_dir=None):
    """(leader address, the worker processes) of ranks 1..world_size-1, killed at the end."""
    port = port or free_ports(1)[0]
    leader = f"127.0.0.1:{port}"
    procs = []
    try:
        for rank in range(1, world_size):
            out = open(log_dir / f"rank{rank}.log", "wb") if log_dir else subprocess.DEVNULL
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "moepipe.ranks.worker", "--leader", leader,
                 "--rank", str(rank), "--checkpoint", str(checkpoint),
                 "--connect-timeout", "120"], stdout=out, stderr=subprocess.STDOUT))
        yield leader, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
