"""Facts of the ``tritonserver`` process shared by every way moepipe runs it (the local server
of :mod:`moepipe.deploy.local`, the pods of :mod:`moepipe.deploy.cluster`): its thread stack
size and the local command line."""

from __future__ import annotations

from pathlib import Path

# Stack size of the server's threads (glibc takes a new thread's default from RLIMIT_STACK).
# Triton's HTTP frontend (libevhtp) parses an ``application/x-www-form-urlencoded`` body (curl
# -d sends that content type) into two variable-length arrays of the body's size on the
# stack: with the usual 8 MiB, a body over ~4 MB overflows it and the server dies of SIGSEGV
# (evhtp_parse_query_wflags). Measured on Triton 2.51 (empty repository, form body of N MB):
# 64 MiB stacks survive 20 MB and die at 40 MB; 1 GiB stacks survive 400 MB and die at 900 MB.
# 1 GiB is address space reserved per thread, not memory (pages are touched only by such a
# request), and under the kernel's default overcommit heuristic one such reservation is
# refused only on a machine with less than 1 GiB of RAM + swap. JSON bodies never take this path.
SERVER_STACK_BYTES = 1 << 30


def local_args(repository: Path, *, host: str, http_port: int, grpc_port: int,
               metrics_port: int, exit_timeout: int, backend_dir: Path | None) -> list[str]:
    """The arguments of a local ``tritonserver`` on ``repository``: every endpoint bound to
    ``host``, Triton's summary latencies exported, no GPU metrics."""
    args = [f"--model-repository={repository}",
            f"--http-address={host}", f"--http-port={http_port}",
            f"--grpc-address={host}", f"--grpc-port={grpc_port}",
            f"--metrics-address={host}", f"--metrics-port={metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--metrics-config=summary_latencies=true",
            f"--exit-timeout-secs={exit_timeout}", "--log-verbose=0"]
    if backend_dir is not None:
        args.append(f"--backend-directory={backend_dir}")
    return args
