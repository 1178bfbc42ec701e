"""Before any job: does the endpoint answer at all? Readiness and one one-token request over
HTTP, readiness over gRPC, within :data:`PREFLIGHT_S` together. Without it a black-holed or
dead endpoint held ``moepipe validate`` for tens of minutes (every check waits its own
``validate.timeout_s``), and the accuracy job computed its whole reference in transformers
first."""

from __future__ import annotations

import time

from moepipe.errors import MoepipeError
from moepipe.validate import client
from moepipe.validate.base import Endpoint
from moepipe.validate.report import JobResult, check, one_line

PREFLIGHT_S = 10.0  # for all three checks together


class EndpointDown(MoepipeError):
    """The endpoint does not answer: validation failed before any job (exit 1, not 2: the
    command was right, the deployment is not)."""

    exit_code = 1


def preflight(ep: Endpoint, prompt: str, budget: float = PREFLIGHT_S) -> JobResult:
    """The endpoint's answers to three quick checks (a job named ``endpoint``); each check
    gets what is left of ``budget``."""
    deadline = time.monotonic() + budget
    job = JobResult("endpoint")

    def left() -> float:
        return max(0.5, min(ep.timeout, deadline - time.monotonic()))

    def http_ready():
        client.http_json(ep.http, "/v2/health/ready", timeout=left())
        return {}

    def http_request():
        out = client.generate(ep.http, "ensemble", {"text_input": prompt, "max_tokens": 1},
                              timeout=left())
        check(isinstance(out.get("text_output"), str),
              f"the ensemble answered without text_output: {str(out)[:200]}")
        return {}

    def grpc_ready():
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(ep.grpc) as c:
            check(c.is_server_ready(client_timeout=left()), "the gRPC endpoint is not ready")
        return {}

    for name, fn in (("http_ready", http_ready), ("http_request", http_request),
                     ("grpc_ready", grpc_ready)):
        if job.run(name, fn).status != "passed":
            break
    return job


def down(job: JobResult, ep: Endpoint, reports: str) -> EndpointDown:
    """The one-line error of a failed :func:`preflight`."""
    case = next(c for c in job.cases if c.status != "passed")
    where = f"grpc {ep.grpc}" if case.name.startswith("grpc") else f"http {ep.http}"
    return EndpointDown(f"the endpoint does not answer ({where}, {case.name}): "
                        f"{one_line(case.message)}; no job was run",
                        f"is the server up and reachable (`moepipe status`, --url, "
                        f"--grpc-url)? reports: {reports}")
