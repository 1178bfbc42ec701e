"""A real tritonserver on loopback, started once for the test run and stopped by PID."""

import pytest
from helpers import free_ports, make_config


@pytest.fixture(scope="session")
def deployment(tmp_path_factory):
    """(config, endpoint) of a built and deployed tiny-mixtral (tp=2, moe_ep=2) on the cpu
    target. The server is stopped by PID when the test run ends."""
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import endpoint_for
    from moepipe.deploy.local import lifecycle

    workdir = tmp_path_factory.mktemp("deployment")
    cfg = make_config(workdir)
    run_build(workdir / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    try:
        yield cfg, endpoint_for(cfg, None, None)
    finally:
        lifecycle.stop(state_dir(cfg), grace=40)


@pytest.fixture(scope="session")
def deployment_not_decoupled(deployment):
    """(config, endpoint) of the same build served with ``deploy.decoupled: false`` (unary
    ModelInfer; no streaming, batch size 1) by a second server on other ports, rendered into
    <workdir>/deploy-not-decoupled. Stopped by PID when the test run ends."""
    from moepipe.commands.deploy import artifacts
    from moepipe.commands.validate import endpoint_for
    from moepipe.deploy.local import lifecycle
    from moepipe.deploy.render.repository import render_deployment

    cfg, _ = deployment
    http, grpc, metrics, ranks = free_ports(4)
    nd = cfg.model_copy(deep=True)
    nd.deploy = nd.deploy.model_copy(update={
        "decoupled": False, "output": cfg.workdir / "deploy-not-decoupled",
        "http_port": http, "grpc_port": grpc, "metrics_port": metrics, "rank_port": ranks})
    repo = render_deployment(nd, artifacts(nd))
    state = cfg.workdir / "server-not-decoupled"
    d = nd.deploy
    lifecycle.start(repo, state, host=d.host, http_port=http, grpc_port=grpc,
                    metrics_port=metrics, timeout=d.ready_timeout_s,
                    exit_timeout=d.exit_timeout_s)
    try:
        yield nd, endpoint_for(nd, None, None)
    finally:
        lifecycle.stop(state, grace=40)


@pytest.fixture(scope="session")
def trained_mixtral(tmp_path_factory):
    """The trained tiny Mixtral, trained once per test run (the session's private cache keeps
    it, so builds in this run, child processes included, copy it instead of training)."""
    from moepipe.examples import write_example

    return write_example("tiny-mixtral-trained",
                         tmp_path_factory.mktemp("trained") / "tiny-mixtral-trained")
