"""What ``moepipe deploy`` records about a running server (``<workdir>/server/server.json``),
read by stop, status, the supervisor and the next deploy."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from moepipe.errors import MoepipeError

STATE_FILE = "server.json"
SERVE_DIR = ".serve"  # `moepipe serve`'s state, beside the repository it serves
CONTROL_SOCKET = "tensorrt_llm.sock"  # the cpu target's live-update channel


def state_dir(workdir: Path) -> Path:
    """Where a workdir's local deployment is recorded. Not "triton": a folder of that name in
    the working directory would shadow OpenAI Triton for `python -m moepipe` run there."""
    return workdir / "server"


def control_socket(workdir: Path) -> Path:
    """The Unix socket the cpu target's model listens on for live updates."""
    return state_dir(workdir) / CONTROL_SOCKET


class ServerError(MoepipeError):
    """The server could not be started, or is not in the expected state."""


@dataclass
class ServerState:
    pid: int
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    repository: str
    log: str
    binary: str
    started: float
    exit_timeout: int = 30
    backend_dir: str | None = None  # --backend-directory (pytriton's server)
    supervisor_pid: int | None = None  # the supervisor watching this server, if any
    restarts: int = 0  # how often the supervisor has restarted it
    max_restarts: int = 0
    models: dict[str, int] | None = None  # model instance -> backend stub pid, once ready
    regions: list[str] | None = None  # its stubs' shared memory (removed after a kill)
    ranks: dict[int, int] | None = None  # worker rank -> pid (a rank group's, else None)

    @property
    def http(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics(self) -> str:
        return f"{self.host}:{self.metrics_port}"

    def to_status(self, running: bool) -> dict:
        return {"running": running, "pid": self.pid, "http": self.http, "grpc": self.grpc,
                "metrics": self.metrics, "repository": self.repository, "log": self.log,
                "supervisor_pid": self.supervisor_pid, "restarts": self.restarts,
                "max_restarts": self.max_restarts,
                **({"ranks": {str(r): p for r, p in self.ranks.items()}} if self.ranks else {})}


def read_state(state_dir: Path) -> ServerState | None:
    path = state_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("ranks"):  # JSON keys are strings
            data["ranks"] = {int(r): pid for r, pid in data["ranks"].items()}
        return ServerState(**data)
    except (json.JSONDecodeError, TypeError):
        return None


def write_state(state_dir: Path, state: ServerState) -> None:
    """Replace ``server.json`` atomically (the supervisor rewrites it on every restart)."""
    tmp = state_dir / f".{STATE_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(asdict(state), indent=2) + "\n")
    os.replace(tmp, state_dir / STATE_FILE)
