"""The fused Triton routing kernel equals the reference routing, under TRITON_INTERPRET=1.

Property tests (hypothesis) over shapes, k, experts, groups, every mode switch, ties (logits
drawn from a coarse grid, so equal values are common) and negative biased scores; expert ids
must match exactly, weights to 1e-6, counts exactly. CI runs a few examples (the interpreter
is slow); tests/e2e runs many more.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moepipe.arch.routing import HF_ROUTING, RoutingSpec, spec_from_hf
from moepipe.runtime.routing import expert_counts, route

triton = pytest.importorskip("triton", reason="OpenAI Triton is not installed")
if not triton.knobs.runtime.interpret:
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

from moepipe.plugins.kernel import launch_config, route_triton  # noqa: E402

EXAMPLES = int(os.environ.get("MOEPIPE_ROUTING_EXAMPLES", "12"))


@st.composite
def routing_cases(draw):
    n_group = draw(st.sampled_from([1, 1, 2, 3, 4]))
    group_size = draw(st.integers(2 if n_group > 1 else 1, 12))
    experts = n_group * group_size
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, min(8, topk_group * group_size)))
    sigmoid = draw(st.booleans())
    topk_first = not sigmoid and draw(st.booleans())
    correction = not topk_first and draw(st.booleans())
    spec = RoutingSpec(
        experts, top_k, score="sigmoid" if sigmoid else "softmax", topk_first=topk_first,
        renormalize=draw(st.booleans()), n_group=n_group, topk_group=topk_group,
        group_score=draw(st.sampled_from(["max", "top2_sum"])),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 16.0])),
        correction_bias=correction, router_bias=draw(st.booleans()))
    tokens = draw(st.integers(1, 9))
    grid = st.integers(-12, 12).map(lambda v: v / 4)  # coarse: many exact ties
    logits = torch.tensor(draw(st.lists(grid, min_size=tokens * experts,
                                        max_size=tokens * experts))).view(tokens, experts)
    biases = {}
    if spec.router_bias:
        biases["router_bias"] = torch.tensor(draw(st.lists(grid, min_size=experts,
                                                           max_size=experts)))
    if spec.correction_bias:
        # mostly negative: biased selection scores below zero
        biases["correction_bias"] = torch.tensor(draw(st.lists(
            st.integers(-16, 4).map(lambda v: v / 8), min_size=experts, max_size=experts)))
    return spec, logits, biases


def assert_kernel_equals_reference(spec, logits, biases):
    ids_r, w_r = route(logits, spec, **biases)
    ids_k, w_k, counts_k = route_triton(logits, spec, biases.get("router_bias"),
                                        biases.get("correction_bias"))
    assert ids_k.dtype == torch.int32 and w_k.dtype == torch.float32
    assert counts_k.dtype == torch.int32 and counts_k.shape == (spec.num_experts,)
    assert torch.equal(ids_k.long(), ids_r), (spec, logits, biases)
    # 1e-6 on weights of order 1 (the scaling factor scales the rounding too)
    torch.testing.assert_close(w_k, w_r, rtol=0, atol=1e-6 * max(1.0, spec.routed_scaling_factor))
    assert torch.equal(counts_k, expert_counts(ids_r, spec.num_experts))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(routing_cases())
def test_kernel_equals_reference(case):
    assert_kernel_equals_reference(*case)


@pytest.mark.parametrize("arch", sorted(HF_ROUTING))
def test_kernel_on_each_family_router(arch):
    from test_routing_reference import hf_router

    config, router = hf_router(arch)
    spec = spec_from_hf(arch, config.to_dict())
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(13, spec.num_experts, generator=gen)
    logits[4] = 0.25  # one token with every expert tied
    biases = {}
    if spec.router_bias:
        biases["router_bias"] = router.bias.detach()
    if spec.correction_bias:
        biases["correction_bias"] = router.e_score_correction_bias - 1.0  # negative scores
    assert_kernel_equals_reference(spec, logits, biases)


def test_programs_stride_over_more_tokens_than_one_pass():
    # more token blocks than programs: each program loops, counts accumulate per program
    spec = RoutingSpec(8, 2, topk_first=True)
    config = launch_config(spec)
    tokens = config.block_t * 3 + 1
    logits = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(3))
    from dataclasses import replace

    small = replace(config, num_programs=2)
    ids_r, w_r = route(logits, spec)
    ids_k, w_k, counts = route_triton(logits, spec, config=small)
    assert torch.equal(ids_k.long(), ids_r)
    assert torch.equal(counts, expert_counts(ids_r, 8))


def test_no_tokens():
    ids, weights, counts = route_triton(torch.zeros(0, 8), RoutingSpec(8, 2))
    assert ids.shape == (0, 2) and weights.shape == (0, 2) and counts.tolist() == [0] * 8
