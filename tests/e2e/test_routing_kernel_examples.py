"""More hypothesis examples of kernel == reference under TRITON_INTERPRET=1 than the unit tier
runs (the interpreter is slow; the unit tier keeps a handful)."""

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
triton = pytest.importorskip("triton", reason="OpenAI Triton is not installed")
if not triton.knobs.runtime.interpret:
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

from test_routing_kernel import assert_kernel_equals_reference, routing_cases  # noqa: E402


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(routing_cases())
def test_kernel_equals_reference_many(case):
    assert_kernel_equals_reference(*case)
