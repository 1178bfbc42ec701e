"""`moepipe ci STEP`, the steps both CI pipelines run, run here as a CI runner runs them: build
(twice: a restored cache reuses every stage), then deploy (cpu) + validate + stop, with the
JUnit, JSON and HTML reports copied where the pipelines publish them from and the results in
GitHub's job summary."""

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
    env = {**os.environ, "MOEPIPE_REPORTS": str(tmp_path / "ci-reports"),
           "GITHUB_STEP_SUMMARY": str(summary)}
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
    suite = ET.parse(reports / "validate.junit.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) > 0
    assert int(suite.get("failures")) == 0 and int(suite.get("errors", 0)) == 0
    text = summary.read_text()
    assert text.startswith("### moepipe validate: passed (cpu target)")
    assert f"| smoke | passed | {suite.get('tests')} | 0 |" in text


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
