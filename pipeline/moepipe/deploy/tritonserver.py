"""The ``tritonserver`` command line, built in one place for every way moepipe runs the server:
the local server (:mod:`moepipe.deploy.local`), the pods and the LeaderWorkerSet leader
(:mod:`moepipe.deploy.cluster`), trtllm-engine's rendered ``launch.sh`` and the command
``moepipe deploy`` prints for a GPU target. They differ only in where the server binds (the
deployment's host, or all of a pod's addresses) and in the flags of one MPI rank.

=================================== ==========================================================
flag                                why
=================================== ==========================================================
--model-repository                  the rendered ``<deploy>/model_repo``
--disable-auto-complete-config      every config.pbtxt is complete (rendered and parsed with
                                    Triton's schema); nothing may be added behind our back
--http/grpc/metrics-address, -port  ``deploy.host`` (pods: 0.0.0.0) and ``deploy.*_port``
--allow-gpu-metrics=false           targets that run on this machine's CPU (no DCGM)
--metrics-config=summary_latencies  the ``*_summary_us`` quantiles the p99 alert and the latency
                                    panels read (:data:`METRICS_CONFIG`)
--metrics-config=histogram_latencies  the first-response (TTFT) histogram of decoupled models
--exit-timeout-secs                 ``deploy.exit_timeout_s``: in-flight requests finish
=================================== ==========================================================

An MPI rank (TensorRT-LLM's leader mode, as ``triton_backend/scripts/launch_triton_server.py``
starts it) adds its own Python-backend shared-memory prefix; ranks after the first load only
``tensorrt_llm`` (they stay in its initialisation and never open their endpoints).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moepipe.targets import get_target

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig

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
# The shell line that raises the soft stack limit before the server starts (scripts and pod
# commands; the local server sets it in the child). Best effort: a lower hard limit is kept
# (`ulimit -S -s` is not POSIX, but dash, bash and busybox sh have it).
RAISE_STACK = f"ulimit -S -s {SERVER_STACK_BYTES >> 10} 2>/dev/null || true"

# Triton's latency summaries and first-response histogram (core src/metric_model_reporter.cc,
# MetricReporterConfig::ParseConfig): the metrics the dashboards and alerts read.
METRICS_CONFIG = ("summary_latencies=true", "histogram_latencies=true")
# The model the worker ranks of an MPI launch load (TensorRT-LLM's C++ backend).
RANK_MODEL = "tensorrt_llm"


@dataclass(frozen=True)
class ServerCommand:
    """The arguments of one deployment's tritonserver."""

    repository: Path
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    exit_timeout: int
    gpu_metrics: bool = False  # DCGM's nv_gpu_* (a GPU machine)

    @classmethod
    def of(cls, cfg: MoepipeConfig, repository: Path, host: str | None = None
           ) -> ServerCommand:
        """The command of ``cfg``'s deployment at ``repository``, bound to ``host`` (default
        ``deploy.host``)."""
        d = cfg.deploy
        return cls(repository, d.host if host is None else host, d.http_port, d.grpc_port,
                   d.metrics_port, d.exit_timeout_s, get_target(cfg.target).gpu)

    def args(self, backend_dir: Path | None = None) -> list[str]:
        """The flags of one server process (``backend_dir``: where its backends are, when not
        the server's default)."""
        args = [f"--model-repository={self.repository}", "--disable-auto-complete-config",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--allow-metrics=true"]
        if not self.gpu_metrics:
            args.append("--allow-gpu-metrics=false")
        args += [f"--metrics-config={setting}" for setting in METRICS_CONFIG]
        args += [f"--exit-timeout-secs={self.exit_timeout}", "--log-verbose=0"]
        if backend_dir is not None:
            args.append(f"--backend-directory={backend_dir}")
        return args

    def rank_args(self, rank: int) -> list[str]:
        """The flags of MPI rank ``rank`` of an engine launched in leader mode."""
        return [*self.args(), *_rank_flags(str(rank), rank > 0)]

    def mpi_ranks(self, binary: str, world: str) -> str:
        """Shell lines that set ``"$@"`` to mpirun's application context of ``world`` ranks
        (``binary`` and ``world``: shell words, e.g. ``"$TRITONSERVER"`` and ``__WORLD__``),
        rank r given :meth:`rank_args` (r)."""
        shm, = _rank_flags('"$rank"', False)
        words = [shlex.quote(a) for a in self.args()] + [shm]
        return "\n".join([
            "set --",
            "rank=0",
            f'while [ "$rank" -lt {world} ]; do',
            '    [ "$rank" -eq 0 ] || set -- "$@" :',
            f'    set -- "$@" -n 1 {binary} \\',
            # the repository on a line of its own: the other lines do not move with its path
            f"        {words[0]} \\",
            _wrapped(words[1:], "        "),
            f'    [ "$rank" -eq 0 ] || set -- "$@" {shlex.join(_worker_flags())}',
            "    rank=$((rank + 1))",
            "done"])


def _wrapped(words: list[str], indent: str, width: int = 96) -> str:
    """Shell words on continued lines of at most ``width`` characters (a longer word alone)."""
    lines: list[str] = []
    for word in words:
        if lines and len(lines[-1]) + 1 + len(word) <= width - 2:
            lines[-1] += " " + word
        else:
            lines.append(indent + word)
    return " \\\n".join(lines)


def _worker_flags() -> list[str]:
    return ["--model-control-mode=explicit", f"--load-model={RANK_MODEL}"]


def _rank_flags(rank: str, worker: bool) -> list[str]:
    """Each rank's own Python-backend shared-memory regions; a worker loads only the engine."""
    shm = f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"
    return [shm, *(_worker_flags() if worker else [])]
