"""``<deploy>/k8s`` and ``<deploy>/monitoring``: what runs the deployment in a cluster and
watches it, written by ``moepipe deploy`` for every target from the same config.

=============================== ==============================================================
value                           source
=============================== ==============================================================
image                           ``deploy.k8s.image``; else GPU targets: the Triton image of
                                ``docker/versions.env``; cpu: ``moepipe-trtllm:<version>``
                                (``docker/Dockerfile`` on that image: the cpu model imports
                                moepipe)
world size, nodes, GPUs/pod     ``parallel`` (tp x pp) over ``deploy.k8s.gpus_per_node``
memory per pod                  ``deploy.k8s.memory_gib``, else the planner's
                                (``moepipe.planner.pods``, set by ``moepipe deploy``), else
                                :func:`memory_estimate_mib` from the built files
/dev/shm size                   64 MiB per Python-model instance, at least 1 GiB
startup probe budget            ``deploy.ready_timeout_s`` (GPU targets: at least 15 min)
ports, exit timeout             ``deploy.<http,grpc,metrics>_port``, ``deploy.exit_timeout_s``
autoscaler, budget              ``deploy.k8s.{min,max}_replicas``, ``autoscale_metric``,
                                ``autoscale_target``
rules, scrape config            ``deploy.monitoring``; the cost rules: ``validate.cost``
environment, scratch folder     ``deploy.trtllm.expert_statistic``: TensorRT-LLM's
                                ``EXPERT_STATISTIC_*`` variables, an emptyDir to write into
=============================== ==============================================================
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moepipe import __version__
from moepipe.config import MoepipeConfig
from moepipe.deploy.cluster import grafana, k8s, monitoring
from moepipe.trtllm.expert_statistic import environment
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER

MIB = 1 << 20
RULES_FILE = "moepipe-rules.yml"


def default_image(target: str) -> str:
    return TRITON_TRTLLM_CONTAINER if target != "cpu" else f"moepipe-trtllm:{__version__}"


def _bytes_under(path: Path | None, pattern: str) -> int:
    if path is None or not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file())


def memory_estimate_mib(cfg: MoepipeConfig, art, nodes: int) -> int:
    """Host memory one pod needs: what it loads, with headroom.

    cpu: the checkpoint's weights held by torch (up-cast to float32 at most: x2 over 16-bit
    files) plus its KV cache (max_batch_size x max_seq_len tokens, float32) plus 2 GiB for
    Triton and the Python models. GPU targets: the node's share of the engine (or checkpoint)
    files, which pass through host memory while loading, plus 8 GiB."""
    if cfg.target == "cpu":
        weights = _bytes_under(art.checkpoint_dir, "rank*.safetensors")
        conf = {}
        if art.checkpoint_dir is not None and (art.checkpoint_dir / "config.json").is_file():
            conf = json.loads((art.checkpoint_dir / "config.json").read_text())
        layers = int(conf.get("num_hidden_layers", 0))
        kv_heads = int(conf.get("num_key_value_heads") or conf.get("num_attention_heads", 0))
        head = int(conf.get("head_size") or (conf.get("hidden_size", 0)
                                               // max(1, conf.get("num_attention_heads", 1))))
        kv = 2 * layers * kv_heads * head * 4 * cfg.build.max_batch_size * cfg.build.max_seq_len
        need = 2 * weights + kv + 2048 * MIB
    else:
        files = (_bytes_under(art.engine_dir, "*.engine")
                 or _bytes_under(art.checkpoint_dir, "*.safetensors")
                 or _bytes_under(art.hf_serving_dir, "*.safetensors"))
        need = files // nodes + 8192 * MIB
    return max(1024, math.ceil(need / (1024 * MIB)) * 1024)


def python_instances(cfg: MoepipeConfig) -> int:
    """Python-model instances of the repository: pre/postprocessing and BLS, and the
    tensorrt_llm model itself except on trtllm-engine (C++ backend)."""
    return 3 * cfg.deploy.instance_count + (cfg.target != "trtllm-engine")


def plan(cfg: MoepipeConfig, art) -> tuple[k8s.PodPlan, k8s.Shape]:
    kc, d = cfg.deploy.k8s, cfg.deploy
    world = cfg.parallel.to_mapping().world_size
    shape = k8s.shape(cfg.target, world, kc.gpus_per_node)
    memory = (math.ceil(kc.memory_gib * 1024) if kc.memory_gib
              else getattr(art, "pod_memory_mib", None)
              or memory_estimate_mib(cfg, art, shape.nodes))
    startup = int(d.ready_timeout_s) if cfg.target == "cpu" else max(int(d.ready_timeout_s), 900)
    window = d.trtllm.expert_statistic
    env = {} if window is None else environment(window.start, window.stop,
                                                k8s.EXPERT_STATISTIC_DIR)
    return k8s.PodPlan(
        name=k8s.check_name(kc.name, "deploy.k8s.name"),
        image=kc.image or default_image(cfg.target), target=cfg.target,
        workdir=cfg.workdir, repo=cfg.deploy_dir / "model_repo",
        ports={"http": d.http_port, "grpc": d.grpc_port, "metrics": d.metrics_port},
        gpus=shape.gpus_per_pod, cpu=f"{kc.cpus:g}", memory_mib=memory,
        shm_mib=k8s.shm_mib(python_instances(cfg)), volume_claim=kc.volume_claim,
        startup_s=startup, exit_timeout_s=d.exit_timeout_s, env=tuple(env.items()),
        scratch=(k8s.EXPERT_STATISTIC_DIR,) if env else ()), shape


def render_operations(cfg: MoepipeConfig, art, out: Path) -> list[Path]:
    """Write ``out/k8s`` and ``out/monitoring``; ``out`` is the deployment folder being
    written (the caller renames it into place when complete)."""
    pod, shape = plan(cfg, art)
    kc, mc = cfg.deploy.k8s, cfg.deploy.monitoring
    hpa_metric = monitoring.HPA_METRICS[kc.autoscale_metric][1]
    (out / "k8s").mkdir(parents=True)
    written = k8s.write(out / "k8s", pod, shape, namespace=kc.namespace,
                        min_replicas=kc.min_replicas, max_replicas=kc.max_replicas,
                        metric=hpa_metric, target=f"{kc.autoscale_target:g}")
    mon = out / "monitoring"
    mon.mkdir()
    rules = monitoring.rules(window_s=mc.rate_window_s, for_s=mc.alert_for_s,
                             slo_p99_ms=mc.slo_p99_ms, max_error_ratio=mc.max_error_ratio,
                             max_queue_ms=mc.max_queue_ms,
                             max_expert_imbalance=mc.max_expert_imbalance,
                             usd_per_hour=cfg.usd_per_hour(),
                             max_usd_per_million_tokens=(
                                 cfg.validation.cost.max_usd_per_million_tokens))
    files = {
        RULES_FILE: monitoring.dump(rules),
        "prometheus.yml": monitoring.dump(monitoring.scrape_config(
            local_target=f"{cfg.deploy.host}:{cfg.deploy.metrics_port}",
            scrape_interval_s=mc.scrape_interval_s,
            evaluation_interval_s=mc.evaluation_interval_s, rule_file=RULES_FILE)),
        "prometheus-adapter.yaml": monitoring.dump(monitoring.adapter_rules(
            kc.autoscale_metric)),
        "grafana-dashboard.json": json.dumps(grafana.dashboard(
            cfg.target, f"moepipe {pod.name} ({cfg.target})", f"moepipe-{pod.name}",
            fallback=cfg.deploy.fallback is not None,
            expert_statistic=cfg.deploy.trtllm.expert_statistic is not None),
            indent=2) + "\n",
    }
    for name, text in files.items():
        (mon / name).write_text(text)
        written.append(mon / name)
    # In a cluster with the Prometheus Operator: the same rules and a PodMonitor.
    operator = out / "k8s" / "prometheus-operator"
    operator.mkdir()
    written += k8s.write_operator(operator, pod, rules, monitoring.JOB)
    return written
