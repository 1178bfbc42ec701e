"""A real tritonserver on loopback, started once for the test run and stopped by PID."""

import pytest
from helpers import make_config


@pytest.fixture(scope="session")
def deployment(tmp_path_factory):
    """(config, endpoint) of a built and deployed tiny-mixtral (tp=2, moe_ep=2) on the cpu
    target. The server is stopped by PID when the test run ends."""
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import endpoint_for
    from moepipe.deploy import server

    workdir = tmp_path_factory.mktemp("deployment")
    cfg = make_config(workdir)
    run_build(workdir / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    try:
        yield cfg, endpoint_for(cfg, None, None)
    finally:
        server.stop(state_dir(cfg), grace=40)
