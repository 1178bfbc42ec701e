"""Validation results: cases grouped by job, written as JSON and JUnit XML."""

from __future__ import annotations

import json
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moepipe.utils.fs import write_text_atomic
from moepipe.utils.progress import current
from moepipe.validate.html import render


@dataclass
class Case:
    name: str
    status: str  # passed | failed | error | skipped
    seconds: float
    message: str = ""
    details: dict = field(default_factory=dict)


@dataclass
class JobResult:
    job: str
    cases: list[Case] = field(default_factory=list)
    data: dict = field(default_factory=dict)  # figures the HTML report draws

    @property
    def passed(self) -> bool:
        return all(c.status in ("passed", "skipped") for c in self.cases)

    def run(self, name: str, fn: Callable[[], dict | None]) -> Case:
        """Run one check: returning details passes, CheckFailed fails, other errors err."""
        current().say(name)  # which check of the job runs, beside its progress
        start = time.perf_counter()
        try:
            details = fn() or {}
            case = Case(name, "passed", 0.0, details=details)
        except Skip as e:
            case = Case(name, "skipped", 0.0, str(e))
        except CheckFailed as e:
            case = Case(name, "failed", 0.0, str(e))
        except Exception as e:  # the endpoint misbehaved or is unreachable
            case = Case(name, "error", 0.0, f"{type(e).__name__}: {e}")
        case.seconds = round(time.perf_counter() - start, 4)
        self.cases.append(case)
        return case


class Skip(Exception):
    """A check that does not apply to this deployment."""


class CheckFailed(Exception):
    """A check found the deployment wrong (a failure, not an error of the endpoint)."""


def check(condition: object, message: str) -> None:
    """Fail the running check with ``message`` unless ``condition`` holds. (Not ``assert``:
    ``python -O`` removes asserts, and every check would pass.)"""
    if not condition:
        raise CheckFailed(message)


# What XML 1.0 cannot hold, even escaped: C0 controls but tab, newline and carriage return;
# lone surrogates; U+FFFE and U+FFFF (https://www.w3.org/TR/xml/#charsets).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_text(text: str) -> str:
    """``text`` as XML can hold it: characters XML 1.0 forbids (a server that answers binary
    garbage puts NULs into messages) are written as ``\\xNN`` / ``\\uNNNN``."""
    return _NOT_XML.sub(lambda m: repr(m.group())[1:-1], text)


def one_line(text: str, limit: int = 300) -> str:
    """``text`` for a one-line message: control characters escaped, at most ``limit``
    characters."""
    text = re.sub(r"[\x00-\x1f\x7f\ud800-\udfff\ufffe\uffff]",
                  lambda m: repr(m.group())[1:-1], text)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Report:
    target: str
    endpoint: dict
    jobs: list[JobResult] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    version: str | None = None  # the weights version validated (the build fingerprint)
    reachable: bool = True  # False: the endpoint did not answer its pre-flight

    @property
    def passed(self) -> bool:
        """Every check passed or was skipped - and at least one passed: a run in which
        nothing was checked (every check skipped, no job) does not pass a CI gate."""
        return all(j.passed for j in self.jobs) and self.checked

    @property
    def checked(self) -> bool:
        return any(c.status == "passed" for j in self.jobs for c in j.cases)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "target": self.target, "endpoint": self.endpoint,
                "version": self.version, "started": self.started,
                "jobs": [{"job": j.job, "passed": j.passed,
                          "cases": [asdict(c) for c in j.cases], "data": j.data}
                         for j in self.jobs]}

    def junit(self) -> str:
        root = ET.Element("testsuites", name="moepipe validate")
        totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for job in self.jobs:
            counts = {"tests": len(job.cases),
                      "failures": sum(c.status == "failed" for c in job.cases),
                      "errors": sum(c.status == "error" for c in job.cases),
                      "skipped": sum(c.status == "skipped" for c in job.cases)}
            suite = ET.SubElement(root, "testsuite", {
                "name": xml_text(job.job), "time": f"{sum(c.seconds for c in job.cases):.3f}",
                **{k: str(v) for k, v in counts.items()}})
            for k, v in counts.items():
                totals[k] += v
            for c in job.cases:
                tc = ET.SubElement(suite, "testcase",
                                   classname=xml_text(f"moepipe.validate.{job.job}"),
                                   name=xml_text(c.name), time=f"{c.seconds:.3f}")
                message = xml_text(c.message)
                if c.status == "failed":
                    ET.SubElement(tc, "failure", message=message).text = message
                elif c.status == "error":
                    ET.SubElement(tc, "error", message=message).text = message
                elif c.status == "skipped":
                    ET.SubElement(tc, "skipped", message=message)
        for k, v in totals.items():
            root.set(k, str(v))
        ET.indent(root)
        return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"

    def write(self, folder: Path) -> tuple[Path, Path, Path]:
        """validate.json, validate.junit.xml and the self-contained validate.html."""
        folder.mkdir(parents=True, exist_ok=True)
        js, xml = folder / "validate.json", folder / "validate.junit.xml"
        page = folder / "validate.html"
        data = self.to_dict()
        write_text_atomic(js, json.dumps(data, indent=2) + "\n")
        write_text_atomic(xml, self.junit())
        write_text_atomic(page, xml_text(render(data)))  # HTML holds what XML can
        return js, xml, page
