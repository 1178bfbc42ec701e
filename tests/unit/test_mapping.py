"""Mapping rules match TensorRT-LLM's Mapping."""

import pytest

from moepipe.arch import get_family
from moepipe.errors import MappingError
from moepipe.mapping import Mapping, legal_mappings, mapping_problems, stage_layers


def test_moe_sizes_default_and_derive():
    assert Mapping.create(tp=4) == Mapping(4, 1, 4, 1)
    assert Mapping.create(tp=4, moe_ep=4) == Mapping(4, 1, 1, 4)
    assert Mapping.create(tp=8, moe_tp=2) == Mapping(8, 1, 2, 4)
    with pytest.raises(MappingError):
        Mapping.create(tp=4, moe_tp=2, moe_ep=4)
    with pytest.raises(MappingError):
        Mapping.create(tp=0)


def test_rank_decomposition_matches_trtllm_docstring():
    # tp=8 moe_tp=2 moe_ep=4: EP groups [0-3], [4-7]; MoE-TP groups [0,4], [1,5], ...
    m = Mapping.create(tp=8, moe_tp=2, moe_ep=4)
    assert [m.moe_ep_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [m.moe_tp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert m.ep_experts(8, 5) == range(2, 4)
    m = Mapping.create(tp=2, pp=2, moe_ep=2)
    assert [(m.tp_rank(r), m.pp_rank(r)) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_pipeline_stages_give_extra_layers_to_the_first():
    assert [list(stage_layers(10, 4, s)) for s in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def _spec(**kw):
    cfg = {"architectures": ["MixtralForCausalLM"], "vocab_size": 100, "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
           "intermediate_size": 42, "num_local_experts": 6, "num_experts_per_tok": 2}
    cfg.update(kw)
    return get_family("MixtralForCausalLM").spec(cfg, "test")


def test_problems_name_the_numbers():
    spec = _spec()
    assert mapping_problems(spec, Mapping.create(tp=4, moe_tp=4)) == [
        "expert intermediate size 42 is not divisible by moe_tp=4"]
    assert "num_experts 6 is not divisible by moe_ep=4" in mapping_problems(
        spec, Mapping.create(tp=4, moe_ep=4))
    assert mapping_problems(_spec(num_key_value_heads=3, num_attention_heads=6, head_dim=16),
                            Mapping.create(tp=2))[0].startswith("num_key_value_heads 3")


def test_legal_mappings_are_all_legal():
    spec = _spec()
    maps = legal_mappings(spec, 8)
    assert Mapping.create(tp=2, moe_ep=2) in maps
    assert all(not mapping_problems(spec, m) for m in maps)
    assert Mapping.create(tp=4, moe_ep=4) not in maps
