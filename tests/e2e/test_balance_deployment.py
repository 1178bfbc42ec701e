"""moepipe balance against a real deployment: the counts come from the running cpu server's
metrics endpoint (the config's own, by default), the placement is one TensorRT-LLM accepts."""

import json
import urllib.request

from moepipe.cli import main
from moepipe.trtllm.load_balancer import read_placement
from moepipe.validate.jobs.balance import settled


def test_balance_from_the_deployments_metrics(deployment, tmp_path, capsys):
    cfg, ep = deployment
    body = json.dumps({"text_input": "Call me Ishmael.", "max_tokens": 8}).encode()
    req = urllib.request.Request(f"http://{ep.http}/v2/models/ensemble/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    settled(f"{cfg.deploy.host}:{cfg.deploy.metrics_port}")  # counters published
    out = tmp_path / "placement.yaml"
    main(["balance", "-c", str(cfg.workdir / "moepipe.yaml"), "--out", str(out), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["moe_ep"] == 2 and summary["num_slots"] == 8 + 2
    assert sorted(summary["layers"]) == ["0", "1", "2", "3"]  # JSON keys
    assert summary["max_over_mean_after"] <= summary["max_over_mean_before"] + 1e-9
    block = read_placement(out, 2)
    assert sorted(block["initial_global_assignments"]) == [0, 1, 2, 3]
