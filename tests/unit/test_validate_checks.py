"""A failing validation check fails, also under ``python -O`` (which strips ``assert``)."""

import subprocess
import sys

SCRIPT = """
from moepipe.validate.report import JobResult, check
job = JobResult("x")
job.run("wrong", lambda: check(1 == 2, "one is not two"))
job.run("right", lambda: check(True, "never") or {"ok": 1})
print(job.cases[0].status, job.cases[0].message, job.cases[1].status, job.passed)
"""


def test_failing_check_fails_with_and_without_optimisation():
    for flags in ([], ["-O"]):
        out = subprocess.run([sys.executable, *flags, "-c", SCRIPT], capture_output=True,
                             text=True, check=True).stdout.split()
        assert out[0] == "failed" and "two" in out and out[-2:] == ["passed", "False"], (flags, out)
