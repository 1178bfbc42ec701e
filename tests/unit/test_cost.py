"""What a token costs: ``validate.cost``'s price, the perf job's US$ per million tokens at its
measured throughput, ``moepipe plan --usd-per-gpu-hour`` per mapping and against the dense model
of the same parameters, and the Prometheus rules (promtool) with their alert."""

import json

import pytest
import yaml
from test_operations import _series, promtool, render

from moepipe.cli import main
from moepipe.config import RUNBOOKS, parse_config
from moepipe.deploy.cluster import monitoring
from moepipe.deploy.cluster.operate import RULES_FILE
from moepipe.errors import ConfigError
from moepipe.utils.cost import usd_per_million
from moepipe.validate.jobs.perf import cost_gate, cost_of
from moepipe.validate.report import CheckFailed

VERSION = "0123456789ab"  # the build version the pods serve (a fingerprint's 12 hex digits)


def test_the_formula():
    """$/M tokens = $/h / (tokens/s x 3600) x 1e6: 3.6 US$/h at 1000 tokens/s is 1 US$."""
    assert usd_per_million(3.6, 1000) == pytest.approx(1.0)
    assert usd_per_million(2.0, 6444) == pytest.approx(2.0 / (6444 * 3600) * 1e6)
    assert usd_per_million(1.0, 0) is None and usd_per_million(1.0, float("nan")) is None


def _cfg(target="cpu", tp=1, pp=1, **cost):
    return parse_config({"model": {"example": "tiny-mixtral"}, "target": target,
                         "parallel": {"tp": tp, "pp": pp}, "validate": {"cost": cost}})


def test_the_price_of_a_deployment():
    assert _cfg(usd_per_hour=0.5).usd_per_hour() == 0.5
    assert _cfg("trtllm-engine", tp=2, pp=2, usd_per_gpu_hour=2.5).usd_per_hour() == 10.0
    assert _cfg().usd_per_hour() is None
    for bad, match in [(dict(usd_per_gpu_hour=2.0), "cpu target has none"),
                       (dict(usd_per_hour=1.0, usd_per_gpu_hour=2.0), "not both"),
                       (dict(max_usd_per_million_tokens=1.0), "needs a price"),
                       (dict(usd_per_hour=-1.0), "greater than 0")]:
        with pytest.raises(ConfigError, match=match):
            _cfg(**bad)


def _summary(out_tps, in_tps):
    return {"output_tokens_per_s": out_tps, "input_tokens_per_s": in_tps}


def test_each_perf_point_is_priced_at_its_throughput():
    c = cost_of(_summary(10.0, 30.0), 3.6)
    assert c == {"usd_per_hour": 3.6, "usd_per_million_output_tokens": 100.0,
                 "usd_per_million_tokens": 25.0}
    assert cost_of(_summary(0.0, 0.0), 3.6)["usd_per_million_output_tokens"] is None
    # a server that counted no prompt tokens gives no blended figure (not an output-only one)
    assert cost_of(_summary(10.0, 0.0), 3.6)["usd_per_million_tokens"] is None


def test_the_cost_gate_judges_the_cheapest_point():
    points = [{"label": f"concurrency {c}", "summary": _summary(t, 3 * t),
               "cost": cost_of(_summary(t, 3 * t), 3.6)} for c, t in ((1, 10.0), (4, 30.0))]
    ok = cost_gate(points, 3.6, 10.0)
    assert ok["cheapest_point"] == "concurrency 4"
    assert ok["usd_per_million_tokens"] == pytest.approx(1e3 / 120)
    with pytest.raises(CheckFailed, match=r"8.333 US\$ per million tokens at the cheapest point "
                                          r"\(concurrency 4, 30 output tokens/s at 3.6 US\$/h\)"
                                          r" > 5 \(validate.cost.max_usd_per_million_tokens\)"):
        cost_gate(points, 3.6, 5.0)


def test_plan_prices_every_mapping_and_the_dense_model(capsys):
    main(["plan", "DeepSeek-V3", "--cluster", "16xH200", "--usd-per-gpu-hour", "3.5",
          "--json"])
    data = json.loads(capsys.readouterr().out)
    for p in data["plans"]:
        if p["fits"]:
            r = p["roofline"]
            assert r["usd_per_million_output_tokens"] == pytest.approx(
                3.5 / (r["tokens_per_s_per_gpu"] * 3600) * 1e6, rel=1e-3)
        else:
            assert "usd_per_million_output_tokens" not in p["roofline"]
    cost = data["cost"]
    assert cost["dense"]["parameters"] == pytest.approx(data["model"]["parameters"], rel=1e-3)
    # 37B of 671B parameters active: the dense model reads and multiplies far more per token
    assert cost["dense_over_moe"] > 2
    assert cost["dense_over_moe"] == pytest.approx(
        cost["dense"]["usd_per_million_output_tokens"] / cost["usd_per_million_output_tokens"],
        rel=1e-3)
    main(["plan", "DeepSeek-V3", "--cluster", "16xH200", "--usd-per-gpu-hour", "3.5"])
    text = capsys.readouterr().out
    assert "$/M out" in text and "dense model of the same 670.9B parameters" in text
    main(["plan", "DeepSeek-V3", "--cluster", "16xH200", "--json"])
    assert "cost" not in json.loads(capsys.readouterr().out)


def test_a_price_that_is_not_one_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "Mixtral-8x7B", "--usd-per-gpu-hour", "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --usd-per-gpu-hour -1 is not a price")


def test_the_cost_rules_and_alert(tmp_path):
    """promtool test rules: per scraped server, the token rate from moepipe's counters or
    TensorRT-LLM's backend histograms, US$ per million output tokens and per million tokens,
    and the alert above validate.cost.max_usd_per_million_tokens after alert_for_s. Counts per
    minute; price 3.6 US$/h = 1000 US$ per million tokens at 1 token/s."""
    cfg, out = render(tmp_path, "trtllm-engine", monitoring={"rate_window_s": 120,
                                                             "alert_for_s": 180})
    assert "moepipe:usd_per_million_tokens" not in (out / "monitoring" / RULES_FILE).read_text()
    rules = monitoring.rules(window_s=120, for_s=180, slo_p99_ms=1e9, max_error_ratio=1,
                             max_queue_ms=1e9, max_expert_imbalance=100, usd_per_hour=3.6,
                             max_usd_per_million_tokens=100)
    (out / "monitoring" / RULES_FILE).write_text(monitoring.dump(rules))
    job = {"job": "moepipe", "model": "tensorrt_llm"}
    inputs = [  # cheap: 100 out/s; dear: 1 out/s + 1 in/s; engine: 10 out/s + 10 in/s
        _series("moepipe_generated_tokens_total", "0+6000x20", instance="cheap", **job),
        _series("moepipe_prompt_tokens_total", "0+0x20", instance="cheap", **job),
        _series("moepipe_generated_tokens_total", "0+60x20", instance="dear", **job),
        _series("moepipe_prompt_tokens_total", "0+60x20", instance="dear", **job),
        _series("nv_llm_output_token_len_sum", "0+600x20", instance="engine",
                response_metric_type="total_output_tokens", **job),
        _series("nv_llm_input_token_len_sum", "0+600x20", instance="engine",
                response_metric_type="total_input_tokens", **job),
        _series("moepipe_generated_tokens_total", "0+0x20", instance="idle", **job),
        _series("moepipe_prompt_tokens_total", "0+0x20", instance="idle", **job)]

    def samples(values):
        return [{"labels": f'{{instance="{i}",job="moepipe"}}', "value": v}
                for i, v in values.items()]

    summary = ("{i} serves tokens at {v} US$ per million (limit 100, at 3.6 US$/h)")
    tests = {"rule_files": [RULES_FILE], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": inputs,
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "MoepipeCostPerTokenHigh", "exp_alerts": []},
            {"eval_time": "10m", "alertname": "MoepipeCostPerTokenHigh", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "instance": "dear", "job": "moepipe"},
                "exp_annotations": {
                    "summary": summary.format(i="dear", v="500"),
                    "description": "Too few tokens for what the deployment costs: scale it "
                                   "in, or send it more traffic.",
                    "runbook_url": f"{RUNBOOKS}#runbook-moepipecostpertokenhigh"}}]}],
        "promql_expr_test": [
            {"expr": f"round({monitoring.recorded(120).cost}, 0.001)", "eval_time": "10m",
             "exp_samples": samples({"cheap": 10, "dear": 500, "engine": 50})},
            {"expr": f"round({monitoring.recorded(120).cost_output}, 0.001)", "eval_time": "10m",
             "exp_samples": samples({"cheap": 10, "dear": 1000, "engine": 100})}],
    }]}
    path = out / "monitoring" / "cost_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    assert "SUCCESS" in promtool("test", "rules", path.name, cwd=out / "monitoring")


def test_rendered_rules_carry_the_configured_price(tmp_path):
    cfg = parse_config({"model": {"example": "tiny-mixtral"}, "target": "trtllm-pytorch",
                        "parallel": {"tp": 2}, "workdir": str(tmp_path / "w"),
                        "validate": {"cost": {"usd_per_gpu_hour": 1.8,
                                              "max_usd_per_million_tokens": 2.0}}})
    from moepipe.deploy.cluster.operate import render_operations

    out = tmp_path / "deploy"
    out.mkdir()
    render_operations(cfg, out, version=VERSION)
    rules = yaml.safe_load((out / "monitoring" / RULES_FILE).read_text())["groups"][0]["rules"]
    by = {r.get("record") or r["alert"]: r for r in rules}
    cost = monitoring.recorded(cfg.deploy.monitoring.rate_window_s).cost
    assert by[cost]["expr"].startswith("1000 / (")  # 2 GPUs x 1.8 US$/h
    assert by["MoepipeCostPerTokenHigh"]["expr"] == f"{cost} > 2"
    assert "SUCCESS" in promtool("check", "rules", RULES_FILE, cwd=out / "monitoring")
