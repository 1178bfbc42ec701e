"""DeepSeek end to end on the cpu target: build (source, inspect, convert, quality), deploy
behind a real tritonserver and validate (smoke + accuracy against transformers, the balance job
over the expert counters) - the tiny DeepSeek-V3 example (MLA, a dense first layer, sigmoid
noaux_tc routing with its correction bias, a shared expert), tp=1, short jobs."""

import json
import urllib.request

from helpers import make_config


def test_deepseek_v3_builds_deploys_and_validates(tmp_path):
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import run_validate
    from moepipe.deploy import server

    cfg = make_config(tmp_path / "ds", example="tiny-deepseek-v3",
                      parallel={"tp": 1, "moe_ep": 1},
                      build={"max_batch_size": 4, "max_input_len": 128, "max_seq_len": 160},
                      validate={"max_tokens": 8, "balance": {"requests": 8, "min_tokens": 20}})
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    ckpt = json.loads((cfg.workdir / "checkpoint" / "config.json").read_text())
    assert ckpt["architecture"] == "DeepseekV3ForCausalLM" and ckpt["moepipe_routing"]
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
        server.stop(state_dir(cfg), grace=40)
