"""Issue 26 (items 8, 9, 14), the parts that need no server: the JUnit report holds whatever a
server answered, validate settings that make a gate vacuous or unbounded are refused, a
validation that checked nothing does not pass, the endpoint is checked in seconds."""

import socket
import time
import xml.etree.ElementTree as ET

import pytest

from moepipe.config import parse_config
from moepipe.errors import ConfigError
from moepipe.validate.report import Case, JobResult, Report

# -- item 8: the JUnit report is well-formed whatever the server answered ---------------------
GARBAGE = "".join(map(chr, range(32))) + "\ud800 \udfff \ufffe \uffff \x7f ok"


def test_junit_is_well_formed_xml_with_binary_garbage_in_messages(tmp_path):
    job = JobResult(f"smoke{GARBAGE}")
    for status in ("failed", "error", "skipped", "passed"):
        job.cases.append(Case(f"{status}{GARBAGE}", status, 0.1, f"server said {GARBAGE}"))
    report = Report("cpu", {"http": "h", "grpc": "g"}, [job])
    js, xml, page = report.write(tmp_path)
    root = ET.parse(xml).getroot()  # expat refuses what XML 1.0 cannot hold
    failure = root.find("testsuite/testcase/failure")
    assert failure is not None and failure.text.startswith("server said \\x00\\x01")
    assert failure.text.endswith("\\ud800 \\udfff \\ufffe \\uffff \x7f ok")
    assert "\x00" not in page.read_text() and js.read_text()


# -- item 14: a validation that checked nothing does not pass ---------------------------------
def test_a_report_with_no_passed_check_does_not_pass():
    skipped = JobResult("recovery", [Case("server", "skipped", 0.0, "not local")])
    assert not Report("cpu", {}, [skipped]).passed
    assert not Report("cpu", {}, []).passed
    passed = JobResult("smoke", [Case("server_live", "passed", 0.1)])
    assert Report("cpu", {}, [skipped, passed]).passed


def _validate(**section):
    return parse_config({"model": {"example": "tiny-mixtral"}, "validate": section})


@pytest.mark.parametrize("section, message", [
    ({"jobs": []}, "validate.jobs: List should have at least 1 item"),
    ({"perf": {"concurrency": [0]}}, "validate.perf.concurrency[0]: Input should be greater"),
    ({"perf": {"concurrency": [4, -1]}}, "validate.perf.concurrency[1]: Input should be greater"),
    ({"perf": {"concurrency": [], "rates": []}}, "concurrency and rates are both empty"),
    ({"perf": {"rates": [0.0]}}, "validate.perf.rates[0]: Input should be greater than 0"),
    ({"perf": {"rates": [-1.0]}}, "validate.perf.rates[0]: Input should be greater than 0"),
    ({"perf": {"rates": [float("inf")]}}, "validate.perf.rates[0]: Input should be a finite"),
    ({"perf": {"rates": [float("nan")]}}, "validate.perf.rates[0]: Input should be a finite"),
    ({"recovery": {"kill": []}}, "validate.recovery.kill: List should have at least 1 item"),
    # item 9: the accuracy job's reference generates this many tokens in transformers
    ({"max_tokens": 100_000}, "validate.max_tokens is 100000; the build serves at most 2047 "
                              "generated tokens (build.max_seq_len 2048"),
    ({"load": {"max_tokens": 4096}}, "validate.load.max_tokens is 4096"),
])
def test_vacuous_or_unbounded_validate_settings_are_refused(section, message):
    with pytest.raises(ConfigError, match="^<config>: ") as e:
        _validate(**section)
    assert message in e.value.message
    assert _validate(perf={"concurrency": [], "rates": [2.5]}).validation.perf.rates == [2.5]


# -- item 9: the endpoint is checked in seconds, before any job -------------------------------
def test_a_black_holed_endpoint_fails_the_preflight_within_its_budget():
    from moepipe.validate.base import Endpoint
    from moepipe.validate.preflight import preflight

    with socket.socket() as hole:  # accepts connections (backlog), never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        url = f"127.0.0.1:{hole.getsockname()[1]}"
        started = time.monotonic()
        job = preflight(Endpoint(http=url, grpc=url, timeout=120.0), "Hello", budget=1.0)
        took = time.monotonic() - started
    assert [(c.name, c.status) for c in job.cases] == [("http_ready", "error")]
    assert "timed out" in job.cases[0].message
    assert took < 60  # not validate.timeout_s (120 s); the budget is 1 s


def test_validate_from_a_workdir_that_built_nothing_hashes_no_model(tmp_path, monkeypatch):
    """A workdir that only validates (a rollout's validate Job: model.path on a mounted volume)
    reports the version the endpoint says, or none: it does not fingerprint the model folder,
    which would read every byte of a large checkpoint."""
    from moepipe.checkpoints import hashcache
    from moepipe.commands.validate import run_validate
    from moepipe.config import parse_config
    from moepipe.errors import MoepipeError

    def hashed(path):
        raise AssertionError(f"hashed {path}")

    monkeypatch.setattr(hashcache, "cached_digest", hashed)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    nowhere = "127.0.0.1:9"  # the discard port: nothing listens
    cfg = parse_config({"model": {"path": str(model)}, "workdir": str(tmp_path / "job"),
                        "validate": {"url": nowhere, "grpc_url": nowhere,
                                     "metrics_url": nowhere, "timeout_s": 2}})
    with pytest.raises(MoepipeError, match="127.0.0.1:9"):
        run_validate(cfg, echo=lambda s: None)
