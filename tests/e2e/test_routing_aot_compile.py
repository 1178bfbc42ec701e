"""Ahead-of-time compilation of the routing kernel for sm_80, sm_90 and sm_100 without a GPU.

``python -m moepipe.plugins.aot`` runs in a subprocess (Triton's interpreter, which the test
session turns on, cannot compile): PTX and cubin (Triton's bundled ptxas) for the smallest and
the largest routing of the registered families, with what TensorRT's AOT plugin needs recorded.
"""

import json
import os
import subprocess
import sys

import pytest

from moepipe.arch.routing import RoutingSpec

pytest.importorskip("triton", reason="OpenAI Triton is not installed")

# spec -> the architectures it is compiled for (every architecture for the small one; the
# DeepSeek-V3-sized one, which takes most of the compile time, for Hopper)
SPECS = {
    "mixtral": (RoutingSpec(8, 2, topk_first=True), ["sm_80", "sm_90", "sm_100"]),
    "deepseek_v3": (RoutingSpec(256, 8, score="sigmoid", renormalize=True, n_group=8,
                                topk_group=4, group_score="top2_sum", routed_scaling_factor=2.5,
                                correction_bias=True), ["sm_90"]),
}
ARCHS = {"sm_80": "sm_80", "sm_90": "sm_90a", "sm_100": "sm_100a"}
PARAMS = ["logits:.u64", "router_bias:.u64", "correction_bias:.u64", "num_tokens:.u32",
          "ids:.u64", "weights:.u64", "counts_partial:.u64"]


@pytest.fixture(scope="module", params=sorted(SPECS))
def compiled(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    spec, archs = SPECS[request.param]
    arch_args = [a for arch in archs for a in ("--arch", arch)]
    done = subprocess.run([sys.executable, "-m", "moepipe.plugins.aot", "--spec",
                           json.dumps(spec.to_dict()), *arch_args, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads((out / "kernels.json").read_text()), archs


def test_every_architecture_gets_ptx_and_cubin(compiled):
    out, manifest, archs = compiled
    assert [k["arch"] for k in manifest["kernels"]] == archs
    for kernel in manifest["kernels"]:
        ptx = (out / f"moe_route.{kernel['arch']}.ptx").read_text()
        assert f".target {ARCHS[kernel['arch']]}" in ptx and kernel["ptx_target"] == \
            ARCHS[kernel["arch"]]
        assert ".entry moe_route(" in ptx
        assert (out / f"moe_route.{kernel['arch']}.cubin").stat().st_size == kernel["cubin_bytes"] > 0


def test_what_tensorrt_needs_is_recorded(compiled):
    _, manifest, _ = compiled
    for kernel in manifest["kernels"]:
        assert kernel["kernel"] == "moe_route" and kernel["triton"] == "3.7.1"
        # the PTX signature is exactly TensorRT's argument list: inputs, scalars, outputs
        assert kernel["params"] == PARAMS
        assert kernel["global_scratch"] == 0
        launch = kernel["launch"]
        assert launch["block_x"] == launch["num_warps"] * 32 and launch["grid_x"] == 512
        assert 0 <= launch["shared_mem"] <= 48 * 1024  # no opt-in shared memory needed


def test_precompiled_kernels_load_for_their_spec_only(compiled):
    from moepipe.errors import UnsupportedError
    from moepipe.plugins.aot import load_kernel

    out, manifest, archs = compiled
    spec = RoutingSpec.from_dict(manifest["spec"])
    kernel = load_kernel(out, spec, "sm_90")
    assert kernel.ptx == (out / "moe_route.sm_90.ptx").read_text()
    assert kernel.block_x == 128 and kernel.grid_x == 512 and kernel.name == "moe_route"
    other = RoutingSpec(spec.num_experts, spec.top_k)  # another routing mode
    with pytest.raises(UnsupportedError, match="no precompiled routing kernel"):
        load_kernel(out, other, "sm_90")
    (out / f"moe_route.{archs[-1]}.ptx").write_text("tampered")
    with pytest.raises(UnsupportedError, match="does not match"):
        load_kernel(out, spec, archs[-1])
