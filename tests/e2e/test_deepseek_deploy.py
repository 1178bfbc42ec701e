"""DeepSeek end to end on the cpu target: build (source, inspect, convert, quality), deploy
behind a real tritonserver and validate (smoke + accuracy against transformers, the balance job
over the expert counters), short jobs:

- the tiny DeepSeek-V3 example (MLA with query compression, a dense first layer, sigmoid
  noaux_tc routing with its correction bias, a shared expert) at tp=1;
- the tiny DeepSeek-V2 example (V2-Lite's MLA without query compression, group-limited greedy
  softmax routing, two shared experts) split over two ranks (tp=2, moe_ep=2: the latent KV
  cache and MLA heads per attention rank, experts per EP rank)."""

import json
import urllib.request

import pytest
from helpers import make_config

CASES = {
    "tiny-deepseek-v3": ("DeepseekV3ForCausalLM", {"tp": 1, "moe_ep": 1}),
    "tiny-deepseek-v2": ("DeepseekV2ForCausalLM", {"tp": 2, "moe_ep": 2}),
}


@pytest.mark.parametrize("example", sorted(CASES))
def test_deepseek_builds_deploys_and_validates(tmp_path, example):
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import run_validate
    from moepipe.deploy.local import lifecycle

    arch, parallel = CASES[example]
    cfg = make_config(tmp_path / "ds", example=example, parallel=parallel,
                      build={"max_batch_size": 4, "max_input_len": 128, "max_seq_len": 160},
                      validate={"max_tokens": 8, "balance": {"requests": 8, "min_tokens": 20}})
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    ckpt = json.loads((cfg.workdir / "checkpoint" / "config.json").read_text())
    assert ckpt["architecture"] == arch
    assert ckpt["mapping"]["world_size"] == parallel["tp"]
    # V3's noaux_tc routing has no TensorRT-LLM 1.2 engine field: moepipe records it
    assert bool(ckpt.get("moepipe_routing")) == (arch == "DeepseekV3ForCausalLM")
    run_deploy(cfg, echo=lambda s: None)
    try:
        report, _ = run_validate(cfg, jobs=["smoke", "accuracy", "balance"],
                                 echo=lambda s: None)
        failed = [f"{j.job}.{c.name}: {c.message}" for j in report.jobs for c in j.cases
                  if c.status not in ("passed", "skipped")]
        assert report.passed, failed
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{cfg.deploy.metrics_port}/metrics", timeout=10).read().decode()
        by_layer: dict[str, float] = {}
        for line in metrics.splitlines():
            if line.startswith("moepipe_expert_tokens_total{"):
                layer = line.split('layer="')[1].split('"')[0]
                by_layer[layer] = by_layer.get(layer, 0.0) + float(line.rsplit(" ", 1)[1])
        # the dense first layer routes nothing; the MoE layers route every token top-2
        assert by_layer["0"] == 0 and by_layer["1"] > 0 and by_layer["1"] == by_layer["2"]
        bal = next(j for j in report.jobs if j.job == "balance")
        assert bal.data["counted_layers"] == [1, 2]  # the balance job skips the dense layer
    finally:
        lifecycle.stop(state_dir(cfg), grace=40)
