"""Gates that must fail, on a deployment of its own (tp=2, moe_ep=2): tiny-mixtral with its
routers made skewed, so every token goes to experts 0-3 (EP rank 0) and experts 4-7 idle;
then the recovery gate with a restart limit of 0 (deploy.max_restarts: the supervisor cleans up
and gives up; the test kills last)."""

import os
import shutil
import signal

import numpy as np
import pytest
from helpers import make_config

from moepipe.commands.validate import run_validate
from moepipe.config import BalanceSection, RecoverySection


def skew_routers(src, dst):
    """Copy a Mixtral checkpoint, rewriting every router so that, for any hidden state h with
    h.w != 0, the top-2 experts are {0, 2} (h.w > 0) or {1, 3} (h.w < 0)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, w in tensors.items():
            if name.endswith("block_sparse_moe.gate.weight"):
                u = w[0] / np.linalg.norm(w[0])
                w = np.zeros_like(w)
                w[0], w[1], w[2], w[3] = 50 * u, -50 * u, 40 * u, -40 * u
                tensors[name] = w
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import endpoint_for
    from moepipe.deploy import server
    from moepipe.examples import write_example

    root = tmp_path_factory.mktemp("skewed")
    model = skew_routers(write_example("tiny-mixtral", root / "tiny"), root / "skewed")
    cfg = make_config(root / "work", model={"path": str(model), "example": None},
                      deploy={"max_restarts": 0})  # supervised, never restarted
    run_build(root / "work" / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    backend = None
    try:
        from moepipe.validate.recovery import backend_pid

        st = server.read_state(state_dir(cfg))
        backend = backend_pid(st.pid) if st else None
        yield cfg, endpoint_for(cfg, None, None)
    finally:
        try:
            server.stop(state_dir(cfg), grace=10)
        except server.ServerError:  # the supervisor gave up after the recovery test's kill
            pass
        if backend is not None:  # a killed server can leave its backend stub behind
            try:
                os.kill(backend, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_skewed_router_fails_the_balance_gate(skewed, tmp_path):
    cfg, ep = skewed
    c = cfg.model_copy(deep=True)
    c.workdir = tmp_path
    c.validation.balance = BalanceSection(requests=8, min_tokens=100, max_std_over_mean=0.5)
    report, _ = run_validate(c, ep.http, ep.grpc, jobs=["balance"], echo=lambda s: None)
    cases = {x.name: x for x in report.jobs[0].cases}
    gate = cases["expert_balance"]
    assert gate.status == "failed", gate
    assert "validate.balance.max_std_over_mean" in gate.message
    data = report.jobs[0].data
    for row in data["layer_expert"]:  # experts 4-7 received nothing
        assert row[4:] == [0.0] * 4
    for row in data["layer_rank"]:  # all of it on EP rank 0
        assert row == [1.0, 0.0]


def test_recovery_fails_with_a_restart_limit_of_0(skewed, tmp_path):
    cfg, ep = skewed
    c = cfg.model_copy(deep=True)
    c.validation.recovery = RecoverySection(kill=["server"], rate=4, warmup_s=1.0,
                                            max_seconds=3.0, after_s=1.0)
    report, _ = run_validate(c, ep.http, ep.grpc, jobs=["recovery"], echo=lambda s: None)
    case = report.jobs[0].cases[0]
    assert case.name == "kill_server" and case.status == "failed", case
    assert "no successful response within 3s after the server was killed" in case.message
    assert "supervisor" in case.message
    run = report.jobs[0].data["runs"][0]
    assert run["requests_lost"] > 0 and run["time_to_first_success_s"] is None
