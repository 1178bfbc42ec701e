"""moepipe balance: placements that lower the hottest EP rank, checked against a brute force on
small cases, and the load_balancer block TensorRT-LLM's LLM API reads (MoeLoadBalancerConfig,
tensorrt_llm/llmapi/llm_args.py; the checks of _torch/modules/fused_moe/fused_moe_wide_ep.py)."""

import itertools
import json
import random

import pytest
import yaml

from moepipe.errors import MoepipeError
from moepipe.planner.balance import (
    balance,
    counts_from_file,
    counts_from_metrics,
    place,
    rank_loads,
    write_placement,
)
from moepipe.trtllm.load_balancer import check_load_balancer, read_placement


def brute_force(counts, ep, num_slots):
    """Lowest possible hottest-rank load over every copy count and every assignment."""
    e, per = len(counts), num_slots // ep
    best = float("inf")
    for copies in itertools.product(range(1, ep + 1), repeat=e):
        if sum(copies) != num_slots:
            continue
        items = [i for i in range(e) for _ in range(copies[i])]
        for perm in set(itertools.permutations(items)):
            slots = list(perm)
            if any(len(set(slots[r * per:(r + 1) * per])) < per for r in range(ep)):
                continue  # two copies of one expert on one rank help nobody
            best = min(best, max(rank_loads(slots, counts, ep)))
    return best


def _cases(n, seed=7):
    rng = random.Random(seed)
    for _ in range(n):
        ep = rng.choice([2, 3])
        experts = ep * rng.choice([1, 2])
        redundant = rng.choice([0, ep]) if experts + ep <= 6 else 0
        counts = [rng.choice([1, 5, 20, 100]) * rng.random() for _ in range(experts)]
        yield counts, ep, experts + redundant


def test_placement_against_brute_force_on_small_cases():
    ratios = []
    for counts, ep, slots in _cases(60):
        got = max(place(counts, ep, slots).rank_load)
        best = brute_force(counts, ep, slots)
        assert got >= best - 1e-9
        ratios.append(got / best)
    # optimal on most cases, never worse than 4/3 of the optimum (the greedy-packing bound)
    assert sum(r < 1 + 1e-9 for r in ratios) >= 0.8 * len(ratios)
    assert max(ratios) <= 4 / 3


def test_placement_is_valid_for_tensorrt_llm():
    rng = random.Random(1)
    counts = [rng.paretovariate(1.2) for _ in range(64)]
    p = place(counts, 8, 72)
    # the assertions of TensorRT-LLM's fused MoE: length num_slots, every expert present
    assert len(p.slots) == 72 and set(p.slots) == set(range(64))
    for r in range(8):  # no rank holds two copies of one expert
        assert len(set(p.slots[r * 9:(r + 1) * 9])) == 9
    assert abs(sum(p.rank_load) - sum(counts)) < 1e-6


def test_skewed_load_is_balanced_and_reported():
    # two hot experts of 16 on 4 ranks: the default contiguous placement puts both on rank 0
    counts = {0: [1000, 900] + [50] * 14, 1: [50] * 14 + [800, 700]}
    plan = balance(counts, moe_ep=4)
    s = plan.summary()
    assert plan.num_slots == 20
    assert s["max_over_mean_before"] > 2.0
    assert s["max_over_mean_after"] < 1.25
    assert s["layers"][0]["after"] < s["layers"][0]["before"]
    lb = plan.load_balancer()
    assert set(lb) == {"num_slots", "layer_updates_per_iter", "initial_global_assignments"}
    assert sorted(lb["initial_global_assignments"]) == [0, 1]


def test_placement_file_round_trip(tmp_path):
    plan = balance({3: [5, 1, 1, 1, 9, 1, 1, 1]}, moe_ep=2, num_slots=10)
    path = tmp_path / "placement.yaml"
    write_placement(plan, path)
    lb = read_placement(path, moe_ep=2)
    assert lb["num_slots"] == 10 and len(lb["initial_global_assignments"][3]) == 10
    assert yaml.safe_load(path.read_text())["predicted"]["max_over_mean_after"] <= \
        yaml.safe_load(path.read_text())["predicted"]["max_over_mean_before"]
    with pytest.raises(MoepipeError, match="moe_ep=2"):
        read_placement(path, moe_ep=4)


def test_counts_from_triton_metrics_text(tmp_path):
    text = "\n".join([
        "# HELP moepipe_expert_tokens_total Tokens routed to each expert of each MoE layer",
        "# TYPE moepipe_expert_tokens_total counter",
        'moepipe_expert_tokens_total{expert="0",layer="0",model="tensorrt_llm"} 12',
        'moepipe_expert_tokens_total{expert="1",layer="0",model="tensorrt_llm"} 3',
        'moepipe_expert_tokens_total{expert="1",layer="1",model="tensorrt_llm"} 7',
        'moepipe_expert_tokens_total{expert="0",layer="1",model="tensorrt_llm"} 0',
        'nv_inference_count{model="ensemble",version="1"} 5'])
    assert counts_from_metrics(text, "m") == {0: [12.0, 3.0], 1: [0.0, 7.0]}
    f = tmp_path / "m.txt"
    f.write_text(text)
    assert counts_from_file(f) == {0: [12.0, 3.0], 1: [0.0, 7.0]}
    j = tmp_path / "c.json"
    j.write_text('{"layers": {"0": [1, 2]}}')
    assert counts_from_file(j) == {0: [1.0, 2.0]}
    # DeepSeek's dense first layer is exported at zero: it has no experts to place
    dense = text + '\nmoepipe_expert_tokens_total{expert="0",layer="2",model="m"} 0' \
        + '\nmoepipe_expert_tokens_total{expert="1",layer="2",model="m"} 0'
    assert counts_from_metrics(dense, "m") == {0: [12.0, 3.0], 1: [0.0, 7.0]}


def test_validate_counters_settle_with_dense_layers_at_zero(monkeypatch):
    """The balance job waits for equal per-layer totals; dense layers (zero) do not count."""
    from moepipe.validate.jobs import balance as job

    counts = {(0, 0): 0.0, (0, 1): 0.0, (1, 0): 3.0, (1, 1): 5.0, (2, 0): 6.0, (2, 1): 2.0}
    monkeypatch.setattr(job, "scrape", lambda url: dict(counts))
    monkeypatch.setattr(job, "SETTLE_PERIOD_S", 0.0)
    assert job.settled("http://x", timeout=1.0) == counts


@pytest.mark.parametrize("counts,ep,slots,match", [
    ([1, 2, 3], 2, None, "cannot be split"),
    ([1, 2, 3, 4], 2, 5, "multiple of moe_ep"),
    ([1, 2, 3, 4], 1, None, "moe_ep >= 2"),
    ([1, 2], 2, 8, "more redundant copies"),
])
def test_bad_balance_requests_are_clear_errors(counts, ep, slots, match):
    with pytest.raises(MoepipeError, match=match):
        balance({0: counts}, ep, slots)


def test_no_metrics_is_a_clear_error():
    with pytest.raises(MoepipeError, match="no moepipe_expert_tokens_total"):
        counts_from_metrics("nv_inference_count 1\n", "x")


def test_tensorrt_llm_rules_refuse_a_bad_block():
    good = {"num_slots": 4, "layer_updates_per_iter": 0,
            "initial_global_assignments": {0: [0, 1, 2, 3]}}
    check_load_balancer(good, 2, "x")
    for bad, match in [({**good, "num_slots": 3}, "multiple of moe_ep"),
                       ({**good, "initial_global_assignments": {0: [0, 1, 1, 3]}},
                        "every expert"),
                       ({**good, "initial_global_assignments": {0: [0, 1, 2]}}, "every expert"),
                       ({**good, "slots": 4}, "unknown key")]:
        with pytest.raises(MoepipeError, match=match):
            check_load_balancer(bad, 2, "x")


def _config(tmp_path, model, **over):
    from moepipe.config import parse_config

    data = {"model": {"path": str(model)}, "target": "trtllm-pytorch",
            "parallel": {"tp": 2, "moe_ep": 2, "attention_dp": True},
            "workdir": str(tmp_path / "work"),
            "deploy": {"trtllm": {"moe_backend": "WIDEEP",
                                  "expert_placement": str(tmp_path / "placement.yaml")}}}
    for key, value in over.items():
        section, _, field = key.partition("__")
        data[section] = {**data.get(section, {}), field: value} if field else value
    return parse_config(data)


def test_deploy_renders_the_placement_into_model_yaml(tmp_path, examples):
    from moepipe.deploy.render.repository import render_deployment
    from moepipe.deploy.render.targets.base import Artifacts

    write_placement(balance({li: [9, 1, 1, 1, 1, 1, 1, 5] for li in range(4)}, moe_ep=2),
                    tmp_path / "placement.yaml")
    cfg = _config(tmp_path, examples["tiny-mixtral"])
    art = Artifacts(version="0123456789ab", model_dir=examples["tiny-mixtral"], checkpoint_dir=tmp_path / "none",
                    vocab_size=512)
    render_deployment(cfg, art)
    text = (cfg.deploy_dir / "model_repo" / "tensorrt_llm" / "1" / "model.yaml").read_text()
    args = yaml.safe_load(text)
    assert args["enable_attention_dp"] is True
    lb = args["moe_config"]["load_balancer"]
    assert args["moe_config"]["backend"] == "WIDEEP"
    assert lb["num_slots"] == 10 and lb["layer_updates_per_iter"] == 0
    assert sorted(lb["initial_global_assignments"]) == [0, 1, 2, 3]  # integer layer keys
    assert all(sorted(set(v)) == list(range(8)) for v in lb["initial_global_assignments"].values())


@pytest.mark.parametrize("over,match", [
    ({"parallel__attention_dp": False}, "needs target trtllm-pytorch, parallel.attention_dp"),
    ({"deploy": {"trtllm": {"moe_backend": "CUTLASS", "expert_placement": "p.yaml"}}},
     "moe_backend: WIDEEP"),
    ({"target": "trtllm-engine", "deploy": {}}, "attention_dp is a TensorRT-LLM PyTorch"),
])
def test_config_refuses_a_placement_tensorrt_llm_would_not_run(tmp_path, over, match):
    with pytest.raises(MoepipeError, match=match):
        _config(tmp_path, tmp_path, **over)


def test_config_takes_a_placement_whose_expert_parallelism_is_derived(tmp_path):
    """``tp: 4, moe_tp: 1`` is moe_ep 4 (TensorRT-LLM derives it): the load balancer's
    placement is accepted as with ``moe_ep: 4`` written out, and both resolve alike."""
    derived = _config(tmp_path, tmp_path, parallel={"tp": 4, "moe_tp": 1, "attention_dp": True})
    spelled = _config(tmp_path, tmp_path, parallel={"tp": 4, "moe_ep": 4, "attention_dp": True})
    assert derived.parallel.to_mapping() == spelled.parallel.to_mapping()
    assert derived.parallel.to_mapping().moe_ep == 4
    with pytest.raises(MoepipeError, match="moe_ep >= 2"):  # moe_tp: 4 leaves moe_ep 1
        _config(tmp_path, tmp_path, parallel={"tp": 4, "moe_tp": 4, "attention_dp": True})


def test_cli_balance_from_a_counts_file(tmp_path, capsys):
    from moepipe.cli import main

    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({"layers": {"0": [400, 300, 10, 10, 10, 10, 10, 10]}}))
    out = tmp_path / "p.yaml"
    main(["balance", "--counts", str(counts), "--moe-ep", "4", "--out", str(out)])
    text = capsys.readouterr().out
    assert "before" in text and "after" in text
    assert read_placement(out, 4)["num_slots"] == 12


def test_counts_from_validate_balance_job(tmp_path):
    # validate.json as moepipe.validate.report writes it, balance job data as
    # moepipe.validate.jobs.balance records it (per-layer shares and tokens)
    report = {"passed": True, "jobs": [
        {"job": "smoke", "passed": True, "cases": [], "data": {}},
        {"job": "balance", "passed": True, "cases": [], "data": {
            "moe_ep": 2, "layer_expert": [[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]],
            "layers": [{"tokens": 40.0}, {"tokens": 8.0}]}}]}
    path = tmp_path / "validate.json"
    path.write_text(json.dumps(report))
    assert counts_from_file(path) == {0: [20.0, 10.0, 10.0, 0.0], 1: [2.0, 2.0, 2.0, 2.0]}
    report["jobs"].pop()
    path.write_text(json.dumps(report))
    with pytest.raises(MoepipeError, match="no balance measurement"):
        counts_from_file(path)


def test_placement_is_keyed_by_decoder_layer_index_past_dense_layers():
    """TensorRT-LLM keys ``initial_global_assignments`` by the decoder layer index of each MoE
    layer, dense layers left out: its EPLB example for DeepSeek-R1 (first_k_dense_replace 3)
    writes keys 3..60 (examples/wide_ep/ep_load_balancer/README.md and
    generate_eplb_config.py, which keys by the statistic's ``layer_idx``). moepipe's counters
    label layers the same way, so a model whose layers 0-1 are dense gives keys 2 and 3."""
    lines = [f'moepipe_expert_tokens_total{{expert="{e}",layer="{layer}",model="m"}} {n}'
             for layer in range(4) for e, n in enumerate([0, 0] if layer < 2 else [9, 1])]
    plan = balance(counts_from_metrics("\n".join(lines), "m"), moe_ep=2)
    assert sorted(plan.load_balancer()["initial_global_assignments"]) == [2, 3]
