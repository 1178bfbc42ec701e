"""What a stopping server shows: its metrics' progress (tokens, finished requests, engine
iterations) and the shutdown countdown of its log. :func:`moepipe.deploy.local.lifecycle.stop`
reads them to kill at once a server whose wait for in-flight work is in vain."""

from __future__ import annotations

import re
import time
from pathlib import Path

from moepipe.deploy.local.state import ServerState
from moepipe.deploy.metric_names import METRICS_LIMIT
from moepipe.utils.bounded import ReadError, fetch_url

# In-flight requests with no visible progress for this long are hung: stop without waiting.
NO_PROGRESS_S = 2.0
# Triton waiting for client connections or in-flight inferences while nothing progresses (no
# token, no finished request, no engine iteration) for this long is waiting in vain: an idle
# keep-alive connection, or a hung request whose engine never published it as running.
DRAIN_IDLE_S = 5.0
# Unloading that has not released a model for this long, with nothing in flight, is stuck
# (Python backends can take seconds to wind down on a busy machine; ensembles take none).
UNLOAD_STALL_S = 12.0
POLL_S = 0.25


_METRIC = re.compile(r"^(\w+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")


def metrics(state: ServerState) -> dict[str, float] | None:
    """The server's metrics, summed over labels (None: not reachable)."""
    try:  # bounded in size and time: a page past the limit is no answer
        text = fetch_url(f"http://{state.metrics}/metrics", METRICS_LIMIT, 1.0,
                         "metrics page").decode(errors="replace")
    except (ReadError, OSError):
        return None
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(2) != "NaN":
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(2))
    return sums


def progress(state: ServerState) -> tuple[float, tuple] | None:
    """(requests in flight, a value that changes whenever any of them progresses)."""
    m = metrics(state)
    if m is None:
        return None
    in_flight = m.get("moepipe_running_requests", 0) \
        + m.get("nv_inference_pending_request_count", 0)
    return in_flight, (m.get("moepipe_generated_tokens_total", 0),
                       m.get("nv_inference_request_success", 0),
                       m.get("nv_inference_request_failure", 0),
                       # TensorRT-LLM's backend: iteration counter and timestamp (per step)
                       m.get("nv_trt_llm_general_metrics", 0))


_LIVE = re.compile(r"Found (\d+) live models and 0 in-flight non-inference requests")
_UNLOADED = re.compile(r"successfully unloaded '([^']+)'")
_UNLOADING = "All models are stopped, unloading models"
_EXIT_TIMEOUT = "Exit timeout expired"
# Triton 2.51's shutdown countdowns (http_server.cc, grpc server, server.cc) while it waits.
_WAITING = re.compile(r"Found (\d+) (HTTP service connections|GRPC service connections|"
                      r"model versions that have in-flight inferences)")


class ShutdownLog:
    """What Triton's log says about its shutdown since :meth:`__init__` (the SIGTERM)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.offset = path.stat().st_size
        except OSError:
            self.offset = 0
        self.live: int | None = None  # live models, from the latest countdown line
        self.live_since = time.monotonic()
        self.unloaded: list[str] = []
        self.unloading = False
        self.timed_out = False
        self.waiting_for: str | None = None  # what Triton's latest countdown waits for

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return
        cut = text.rfind("\n") + 1  # leave a half-written line for the next read
        self.offset += len(text[:cut].encode())
        for line in text[:cut].splitlines():
            self.unloading = self.unloading or _UNLOADING in line
            self.timed_out = self.timed_out or _EXIT_TIMEOUT in line
            if m := _WAITING.search(line):
                self.waiting_for = f"{m.group(1)} {m.group(2)}" if int(m.group(1)) else None
            if m := _UNLOADED.search(line):
                self.unloaded.append(m.group(1))
            if (m := _LIVE.search(line)) and int(m.group(1)) != self.live:
                self.live, self.live_since = int(m.group(1)), time.monotonic()

    def stuck(self, models: dict[str, bool]) -> bool:
        """Unloading with nothing in flight, and the live-model count has not moved for
        :data:`UNLOAD_STALL_S` - or, when only ensembles are left (they have no backend to
        wind down), for :data:`NO_PROGRESS_S`."""
        if not (self.unloading and self.live):
            return False
        left = [name for name in models if name not in self.unloaded]
        only_ensembles = bool(left) and all(models[name] for name in left)
        stalled = time.monotonic() - self.live_since
        return stalled > (NO_PROGRESS_S if only_ensembles else UNLOAD_STALL_S)


def models(state: ServerState) -> dict[str, bool]:
    """Model name -> is it an ensemble, for the deployment's repository."""
    repo = Path(state.repository) if state.repository else None
    if repo is None or not repo.is_dir():
        return {}
    found = {}
    for config in sorted(repo.glob("*/config.pbtxt")):
        text = config.read_text(errors="replace")
        found[config.parent.name] = re.search(r'platform:\s*"ensemble"', text) is not None
    return found
