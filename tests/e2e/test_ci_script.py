"""ci/moepipe-ci.sh, the one script both CI pipelines call, run here as CI runs it: build, then
deploy (cpu) + validate + stop, with the JUnit and JSON reports copied where the pipelines
publish them from."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from helpers import make_config

from moepipe.commands.deploy import state_dir
from moepipe.deploy.local import lifecycle

SCRIPT = Path(__file__).parents[2] / "ci" / "moepipe-ci.sh"


def _run(step: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), step], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_ci_script_builds_deploys_validates_and_stops(tmp_path):
    cfg = make_config(tmp_path / "project", validate={"jobs": ["smoke"]})
    project = tmp_path / "project"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "MOEPIPE": str(bin_dir / "moepipe"), "PYTHON": sys.executable,
           "MOEPIPE_REPORTS": str(tmp_path / "ci-reports")}
    try:
        build = _run("build", project, env)
        assert build.returncode == 0, build.stdout + build.stderr
        again = _run("build", project, env)  # what a restored CI cache gives: all reused
        assert again.returncode == 0 and "reused" in (again.stdout + again.stderr).lower(), \
            again.stdout + again.stderr
        run = _run("deploy-validate", project, env)
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        running = lifecycle.status(state_dir(cfg)).get("running")
        if running:
            lifecycle.stop(state_dir(cfg), grace=40)
    assert not running  # the script stopped it
    junit = list((tmp_path / "ci-reports").glob("*.xml"))
    assert junit, list((tmp_path / "ci-reports").iterdir())
    suite = ET.parse(junit[0]).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert int(suite.get("tests")) > 0
    assert int(suite.get("failures")) == 0 and int(suite.get("errors", 0)) == 0
    assert list((tmp_path / "ci-reports").glob("*.json"))


def test_ci_script_refuses_unknown_steps_and_missing_configs(tmp_path):
    env = {**os.environ, "MOEPIPE_CONFIG": str(tmp_path / "absent.yaml")}
    res = _run("build", tmp_path, env)
    assert res.returncode == 2 and res.stderr.startswith("error: no pipeline config")
    (tmp_path / "moepipe.yaml").write_text("{}\n")
    res = _run("deploy-everything", tmp_path, {**os.environ})
    assert res.returncode == 2 and "unknown step" in res.stderr
