"""`moepipe ci STEP`, the steps both CI pipelines run, run here as a CI runner runs them: build
(twice: a restored cache reuses every stage), then deploy (cpu) + validate + a short soak +
stop, with the JUnit, JSON and HTML reports copied where the pipelines publish them from and
the results in GitHub's job summary."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from helpers import make_config

from moepipe.commands.deploy import state_dir
from moepipe.deploy.local import lifecycle


def _ci(*args, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moepipe", "ci", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_ci_steps_build_deploy_validate_stop_and_publish(tmp_path):
    cfg = make_config(tmp_path / "project", validate={"jobs": ["smoke"]})
    project = tmp_path / "project"
    summary = tmp_path / "step-summary.md"
    # the pipelines' soak (60 s) shortened, through the variable they set
    env = {**os.environ, "MOEPIPE_REPORTS": str(tmp_path / "ci-reports"),
           "GITHUB_STEP_SUMMARY": str(summary), "MOEPIPE_SOAK_SECONDS": "24"}
    try:
        build = _ci("build", cwd=project, env=env)
        assert build.returncode == 0, build.stdout + build.stderr
        again = _ci("build", cwd=project, env=env)  # what a restored CI cache gives: all reused
        assert again.returncode == 0 and "reused" in (again.stdout + again.stderr).lower(), \
            again.stdout + again.stderr
        run = _ci("deploy-validate", cwd=project, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        running = lifecycle.status(state_dir(cfg)).get("running")
        if running:
            lifecycle.stop(state_dir(cfg), grace=40)
    assert not running  # the step stopped it
    reports = tmp_path / "ci-reports"
    assert sorted(p.name for p in reports.iterdir()) == ["validate.html", "validate.json",
                                                         "validate.junit.xml"]
    suites = {s.get("name"): s for s in
              ET.parse(reports / "validate.junit.xml").getroot().iter("testsuite")}
    assert list(suites) == ["smoke", "soak"]  # the soak after the config's jobs
    for suite in suites.values():
        assert int(suite.get("tests")) > 0
        assert int(suite.get("failures")) == 0 and int(suite.get("errors", 0)) == 0
    text = summary.read_text()
    assert text.startswith("### moepipe validate: passed (cpu target)")
    assert f"| smoke | passed | {suites['smoke'].get('tests')} | 0 |" in text
    assert f"| soak | passed | {suites['soak'].get('tests')} | 0 | 0 |" in text
    # the soak ran for the pipeline's length and measured the deployment it ran against: its
    # processes' memory and its KV slots, each trend from samples after the warm-up window
    soak = json.loads((reports / "validate.json").read_text())["jobs"][1]
    assert soak["data"]["seconds"] == 24 and soak["data"]["outcomes"]["ok"] > 0
    assert {c["name"]: c["status"] for c in soak["cases"]} == {
        "steady_load": "passed", "error_rate": "passed", "latency_drift": "passed",
        "memory_trend": "passed", "kv_trend": "passed", "no_restarts": "passed",
        "client_not_saturated": "passed"}
    assert len(soak["data"]["memory"]["samples"]) >= 8


def test_ci_refuses_unknown_steps_missing_configs_and_the_wrong_target(tmp_path):
    env = {**os.environ, "MOEPIPE_CONFIG": str(tmp_path / "absent.yaml")}
    res = _ci("build", cwd=tmp_path, env=env)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and \
        "absent.yaml: no such config file" in res.stderr
    res = _ci("deploy-everything", cwd=tmp_path, env=dict(os.environ))
    assert res.returncode == 2 and "'deploy-everything' is not one of 'build'" in res.stderr
    (tmp_path / "moepipe.yaml").write_text("model: {example: tiny-mixtral}\n"
                                           "target: trtllm-engine\n")
    res = _ci("deploy-validate", cwd=tmp_path, env=dict(os.environ))
    assert res.returncode == 2 and "use `moepipe ci gpu-validate`" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
