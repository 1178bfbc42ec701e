"""A real Prometheus server (Debian's package) on loopback scrapes two cpu deployments and
evaluates the rules moepipe renders: the expert-imbalance alert fires for the model whose router
sends every token to the same experts, and stays silent for the shared tiny-mixtral (random
router). Short scrape/evaluation intervals, rate window and `for:` keep it to seconds."""

import json
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest
import yaml
from helpers import free_ports, make_config

from moepipe.deploy.cluster import monitoring
from moepipe.validate import client

LIMIT = 1.0  # std/mean; two experts of eight taking every token give sqrt(3) = 1.73


def _skewed_checkpoint(root):
    """tiny-mixtral with all-zero router weights: every token's logits tie, and top-k then
    picks the same two experts for every token."""
    from safetensors.torch import load_file, save_file

    from moepipe.examples import write_example

    model = write_example("tiny-mixtral", root / "skewed-hf")
    for path in model.glob("*.safetensors"):
        tensors = load_file(path)
        gates = [k for k in tensors if k.endswith("block_sparse_moe.gate.weight")]
        assert gates
        for k in gates:
            tensors[k] = tensors[k] * 0
        save_file(tensors, path, metadata={"format": "pt"})
    return model


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.deploy.local import lifecycle

    root = tmp_path_factory.mktemp("skewed")
    model = _skewed_checkpoint(root)
    make_config(root / "work")
    data = yaml.safe_load((root / "work" / "moepipe.yaml").read_text())
    data["model"] = {"path": str(model)}
    (root / "work" / "moepipe.yaml").write_text(yaml.safe_dump(data))
    from moepipe.config import load_config

    cfg = load_config(root / "work" / "moepipe.yaml")
    run_build(root / "work" / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    try:
        yield cfg
    finally:
        lifecycle.stop(state_dir(cfg), grace=40)


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, deployment, skewed):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (scripts/install-test-tools.sh)")
    balanced, _ = deployment
    root = tmp_path_factory.mktemp("prometheus")
    rules = monitoring.rules(window_s=6, for_s=3, slo_p99_ms=60000, max_error_ratio=0.5,
                             max_queue_ms=60000, max_expert_imbalance=LIMIT)
    (root / "rules.yml").write_text(monitoring.dump(rules))
    conf = monitoring.scrape_config(local_target="unused", scrape_interval_s=1,
                                    evaluation_interval_s=1, rule_file="rules.yml")
    conf["scrape_configs"][0]["static_configs"] = [{"targets": [
        f"127.0.0.1:{c.deploy.metrics_port}" for c in (balanced, skewed)]}]
    (root / "prometheus.yml").write_text(monitoring.dump(conf))
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [binary, f"--config.file={root / 'prometheus.yml'}",
         f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(root / "prometheus.log").open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("prometheus did not start: "
                                       + (root / "prometheus.log").read_text()[-2000:]) from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _traffic(cfg, stop):
    url = f"{cfg.deploy.host}:{cfg.deploy.http_port}"
    i = 0
    while not stop.is_set():
        client.generate(url, "ensemble", {"text_input": f"Request {i}: the quick brown fox",
                                          "max_tokens": 8})
        i += 1


def _alerts(url, name):
    data = _get(f"{url}/api/v1/alerts")["data"]["alerts"]
    return [a for a in data if a["labels"]["alertname"] == name]


def test_expert_imbalance_alert_fires_only_for_the_skewed_router(prometheus, deployment, skewed):
    balanced, _ = deployment
    router = {f"127.0.0.1:{balanced.deploy.metrics_port}": "even",
              f"127.0.0.1:{skewed.deploy.metrics_port}": "skewed"}
    stop = threading.Event()
    workers = [threading.Thread(target=_traffic, args=(c, stop), daemon=True)
               for c in (balanced, skewed)]
    for w in workers:
        w.start()
    try:
        deadline = time.monotonic() + 60
        firing = []
        while time.monotonic() < deadline:
            firing = [a for a in _alerts(prometheus, "MoepipeExpertImbalance")
                      if a["state"] == "firing"]
            if "skewed" in {router[a["labels"]["instance"]] for a in firing}:
                break
            time.sleep(1)
        values = _get(f"{prometheus}/api/v1/query?query="
                      + urllib.request.quote(monitoring.recorded(6).expert_imbalance))["data"]["result"]
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
    by_router: dict[str, list[float]] = {}
    for r in values:
        by_router.setdefault(router[r["metric"]["instance"]], []).append(float(r["value"][1]))
    assert by_router.get("skewed") and min(by_router["skewed"]) > LIMIT, by_router
    assert by_router.get("even") and max(by_router["even"]) < LIMIT, by_router
    assert {router[a["labels"]["instance"]] for a in firing} == {"skewed"}, firing
    # Every layer of the skewed model fires (all its routers are zero); the balanced
    # deployment has no alert at all, not even a pending one.
    assert len({a["labels"]["layer"] for a in firing}) == len(by_router["skewed"])
    assert not [a for a in _alerts(prometheus, "MoepipeExpertImbalance")
                if router[a["labels"]["instance"]] == "even"]
