"""``<deploy>/locust``: a Locust load test of the deployment, for users who load-test with
Locust (``cd <deploy>/locust && locust``).

Written by ``moepipe deploy`` for every target: ``locustfile.py`` (templates' ``locust/``:
HTTP ``generate_stream`` and gRPC stream users, each reporting time to first token),
``sse_events.py`` (a copy of :mod:`moepipe.utils.sse`, so the file runs where moepipe is not
installed), ``prompts.json`` (``validate.prompts``) and ``locust.conf``: the deployment's
HTTP and gRPC addresses (a server bound to every interface is load-tested on loopback),
``validate.load.max_tokens`` and a run that stops by itself.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

from moepipe.config import MoepipeConfig
from moepipe.deploy.render.templates import templates_root

ANY_ADDRESS = ("0.0.0.0", "::", "")


def conf(cfg: MoepipeConfig) -> str:
    """locust.conf for this deployment."""
    d, v = cfg.deploy, cfg.validation
    host = "127.0.0.1" if d.host in ANY_ADDRESS else d.host
    host = f"[{host}]" if ":" in host else host
    lines = [
        "# Locust settings for this deployment (written by `moepipe deploy`); the command line",
        "# overrides them. Options of locustfile.py: grpc-host, model, max-tokens, prompts,",
        "# request-timeout.",
        "locustfile = locustfile.py",
        f"host = http://{host}:{d.http_port}",
        f"grpc-host = {host}:{d.grpc_port}",
        "model = ensemble",
        f"max-tokens = {v.load.max_tokens}",
        f"request-timeout = {v.load.request_timeout_s:g}",
        "users = 4",
        "spawn-rate = 4",
        "run-time = 1m",
    ]
    return "\n".join(lines) + "\n"


def write(out: Path, cfg: MoepipeConfig) -> list[Path]:
    """Write the Locust folder ``out``; returns its files."""
    out.mkdir(parents=True)
    shutil.copy2(templates_root() / "locust" / "locustfile.py", out / "locustfile.py")
    sse = resources.files("moepipe.utils").joinpath("sse.py")
    (out / "sse_events.py").write_text(sse.read_text())
    (out / "prompts.json").write_text(json.dumps(cfg.validation.prompts, indent=2) + "\n")
    (out / "locust.conf").write_text(conf(cfg))
    return sorted(out.iterdir())
