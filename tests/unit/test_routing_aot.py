"""The PTX post-processing of the AOT compile (the compile itself: tests/e2e/test_routing_aot.py)."""

import pytest

from moepipe.errors import UnsupportedError
from moepipe.plugins.aot import strip_scratch_params

PTX = """.version 8.7
.target sm_90a
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u32 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2,
\t.param .u64 .ptr .global .align 1 k_param_3
)
{
\tld.param.b64 \t%rd1, [k_param_0];
\tld.param.b32 \t%r1, [k_param_1];
\tret;
}
"""


def test_unused_scratch_parameters_are_removed():
    out = strip_scratch_params(PTX, "k", keep=2)
    assert "k_param_2" not in out and "k_param_3" not in out
    assert "k_param_0,\n\t.param .u32 k_param_1\n)" in out
    assert out.endswith("ret;\n}\n")


def test_a_kernel_that_reads_scratch_is_refused():
    used = PTX.replace("ret;", "ld.param.b64 \t%rd2, [k_param_2];\n\tret;")
    with pytest.raises(UnsupportedError, match="scratch parameter k_param_2"):
        strip_scratch_params(used, "k", keep=2)
