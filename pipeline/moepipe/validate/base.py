"""What a validation job is and what it sees: the endpoint, the config and what the build
produced (:class:`JobContext`). Each job is one module of :mod:`moepipe.validate.jobs` with a
function ``JobContext -> JobResult``; :mod:`moepipe.validate.registry` lists them in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moepipe.config import MoepipeConfig
from moepipe.validate import client
from moepipe.validate.report import JobResult

MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")


@dataclass
class Endpoint:
    http: str  # host:port
    grpc: str
    timeout: float = 120.0
    metrics: str | None = None  # host:port of the Prometheus metrics endpoint
    # Triton request parameters every inference request of smoke and accuracy carries (a
    # live update validates a staged weights version with {"moepipe_version": ...})
    parameters: dict | None = None

    def get(self, path: str) -> dict:
        return client.http_json(self.http, path, timeout=self.timeout)

    def decoupled(self) -> bool:
        cfg = self.get("/v2/models/tensorrt_llm/config")
        return bool(cfg.get("model_transaction_policy", {}).get("decoupled", False))


@dataclass
class JobContext:
    """What a job gets: the endpoint, the config, and what the build produced."""

    endpoint: Endpoint
    cfg: MoepipeConfig
    model_dir: Path | None = None  # the source Hugging Face checkpoint
    checkpoint_dir: Path | None = None  # the converted TensorRT-LLM checkpoint (if any)
    state_dir: Path | None = None  # the local server's state (pid file), for `recovery`


Job = Callable[[JobContext], JobResult]
