"""Targets as data: each target declares once what it needs and supports (moepipe.targets), the
config, the stages, the renderer and the planner look it up, and nothing in the package
branches on a target's name."""

import re
from pathlib import Path

import pytest

from moepipe.config import field_info, parse_config
from moepipe.deploy.metric_names import GROUPS
from moepipe.deploy.render.targets import VALUES
from moepipe.deploy.render.templates import templates_root
from moepipe.errors import ConfigError, MoepipeError
from moepipe.stages.registry import STAGES
from moepipe.targets import TARGETS, get_target

PACKAGE = Path(__file__).parents[2] / "pipeline" / "moepipe"


def test_the_config_offers_exactly_the_declared_targets():
    assert field_info("target")[1] == tuple(TARGETS)
    with pytest.raises(ConfigError, match="choose 'cpu', 'trtllm-engine' or 'trtllm-pytorch'"):
        parse_config({"model": {"example": "tiny-mixtral"}, "target": "vllm"})


def test_an_unknown_target_lists_the_supported_ones():
    with pytest.raises(ConfigError) as err:
        get_target("vllm")
    assert "target 'vllm' is unknown" in err.value.message
    assert err.value.hint == "choose one of cpu, trtllm-engine, trtllm-pytorch"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_declaration_is_complete(name):
    """Its stages are registered (in build order), it has template values and templates, its
    formats are the config's choices, its metric groups exist."""
    t = TARGETS[name]
    order = [s.name for s in STAGES]
    assert list(t.stages) == [s for s in order if s in t.stages]
    assert {"source", "inspect"} <= set(t.stages)
    assert name in VALUES and (templates_root() / "targets" / name).is_dir()
    assert set(t.quant_formats) <= set(field_info("quantize.format")[1])
    assert set(t.kv_cache_formats) <= set(field_info("quantize.kv_cache")[1])
    assert "none" in t.quant_formats and "none" in t.kv_cache_formats
    assert t.metrics and set(t.metrics) <= GROUPS.keys()
    assert t.gpu or not t.mpi_ranks  # a CPU rank group is moepipe's processes, not MPI


def test_template_values_exist_only_for_declared_targets():
    assert VALUES.keys() == TARGETS.keys()


def _needed(target, **extra):
    cfg = parse_config({"model": {"example": "tiny-mixtral"}, "target": target, **extra})
    return [s.name for s in STAGES if s.needed(cfg)]


def test_the_stages_a_build_runs_come_from_the_target():
    assert _needed("cpu") == ["source", "inspect", "convert"]
    assert _needed("trtllm-engine") == ["source", "inspect", "convert", "engine"]
    assert _needed("trtllm-pytorch") == ["source", "inspect"]
    assert _needed("trtllm-pytorch", quantize={"format": "fp8"}) == \
        ["source", "inspect", "quantize", "quality"]


@pytest.mark.parametrize("target,quantize,needle", [
    ("trtllm-pytorch", {"format": "int8_sq"},
     "quantize.format int8_sq is not served by the TensorRT-LLM PyTorch backend, which takes "
     "fp8, int4_awq or nvfp4 (target cpu or trtllm-engine serves it)"),
    ("trtllm-pytorch", {"format": "fp8", "kv_cache": "int8"},
     "quantize.kv_cache int8 is not served by the TensorRT-LLM PyTorch backend; use fp8 (or "
     "target cpu or trtllm-engine)"),
])
def test_formats_a_target_does_not_serve_are_refused_with_the_alternatives(target, quantize,
                                                                          needle):
    with pytest.raises(ConfigError) as err:
        parse_config({"model": {"example": "tiny-mixtral"}, "target": target,
                      "quantize": quantize})
    assert needle in err.value.message
    for other in ("cpu", "trtllm-engine"):
        parse_config({"model": {"example": "tiny-mixtral"}, "target": other,
                      "quantize": quantize})


def test_rendering_an_undeclared_target_says_what_renders():
    from moepipe.deploy.render.targets import values_of

    with pytest.raises(MoepipeError) as err:
        values_of("vllm")
    assert err.value.hint == "renderable: cpu, trtllm-engine, trtllm-pytorch"


# `target == "cpu"`, `cfg.target != "trtllm-engine"`, `target in ("cpu", ...)`: a decision
# that belongs in the target's declaration.
_BRANCH = re.compile(r"""target\s*(==|!=)\s*["']|target\s+(not\s+)?in\s*[(\[{]\s*["']""")


def test_no_module_branches_on_a_target_name():
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] != "targets"  # the declarations
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if _BRANCH.search(line)]
    assert found == []
