"""``<deploy>/k8s`` and ``<deploy>/monitoring``: what runs the deployment in a cluster and
watches it, written by ``moepipe deploy`` for every target from the same config.

=============================== ==============================================================
value                           source
=============================== ==============================================================
image                           ``deploy.k8s.image``; else GPU targets: the Triton image of
                                ``docker/versions.env``; cpu: ``moepipe-trtllm:<version>``
                                (``docker/Dockerfile`` on that image: the cpu model imports
                                moepipe)
release                         the build version served (``moepipe status``'s): the
                                workload ``<name>-<release[:8]>`` reads
                                ``<deploy>/releases/<release>/model_repo``
validate Job                    the config's smoke / accuracy against the release's Service,
                                in ``moepipe-trtllm:<version>`` (:mod:`.rollout`)
world size, nodes, GPUs/pod     ``parallel`` (tp x pp) over ``deploy.k8s.gpus_per_node``
memory per pod                  ``deploy.k8s.memory_gib``, else the sizing model's
                                (:func:`pod_memory`, ``moepipe.sizing.pods``)
/dev/shm size                   64 MiB per Python-model instance, at least 1 GiB
startup probe budget            ``deploy.ready_timeout_s``, at least ``Target.min_startup_s``
                                (GPU targets: 15 min)
ports, exit timeout             ``deploy.<http,grpc,metrics>_port``, ``deploy.exit_timeout_s``
server flags                    :class:`moepipe.deploy.tritonserver.ServerCommand`, on 0.0.0.0
workdir volume mount            ``deploy.serve_root`` (default: the workdir's path)
autoscaler, budget              ``deploy.k8s.{min,max}_replicas``, ``autoscale_metric``,
                                ``autoscale_target``
rules, scrape config            ``deploy.monitoring`` (runbook_url: ``runbooks``); the cost
                                rules: ``validate.cost``
environment, scratch folder     ``deploy.trtllm.expert_statistic``: TensorRT-LLM's
                                ``EXPERT_STATISTIC_*`` variables, an emptyDir to write into
dashboard uid                   ``moepipe-<deploy.k8s.name>``, hashed to 40 characters
                                (:func:`moepipe.deploy.cluster.grafana.dashboard_uid`); also
                                a ConfigMap for Grafana's sidecar in ``k8s/grafana``
=============================== ==============================================================
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moepipe import __version__
from moepipe.config import MoepipeConfig
from moepipe.deploy.cluster import grafana, k8s, monitoring, rollout
from moepipe.deploy.metric_names import exported
from moepipe.deploy.serve_paths import ServePaths, release_config
from moepipe.deploy.tritonserver import ServerCommand
from moepipe.errors import CheckpointError
from moepipe.sizing.pods import pod_memory_mib
from moepipe.sizing.shapes import load_shape
from moepipe.sizing.weights import Sharding
from moepipe.targets import get_target
from moepipe.trtllm.expert_statistic import environment
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER

RULES_FILE = "moepipe-rules.yml"


def default_image(target: str) -> str:
    """The image a target's pods run (``Target.image``): NVIDIA's Triton + TensorRT-LLM image,
    or moepipe's built on it."""
    return {"triton": TRITON_TRTLLM_CONTAINER,
            "moepipe": f"moepipe-trtllm:{__version__}"}[get_target(target).image]


def pod_memory(cfg: MoepipeConfig) -> int:
    """Host memory of one serving pod in MiB (the Kubernetes memory request and limit):
    ``deploy.k8s.memory_gib``, else the sizing model's for the configured model, target,
    mapping and limits (:mod:`moepipe.sizing.pods`)."""
    kc, p, b = cfg.deploy.k8s, cfg.parallel, cfg.build
    if kc.memory_gib:
        return math.ceil(kc.memory_gib * 1024)
    source = cfg.model.path or cfg.model.example or ""
    model = load_shape(source)
    if model is None:
        raise CheckpointError(f"{source}: no config.json to size the pods by",
                              "run `moepipe build` first, or set deploy.k8s.memory_gib")
    m = p.to_mapping()
    gpus = k8s.shape(cfg.target, m.world_size, kc.gpus_per_node).gpus_per_pod
    return pod_memory_mib(model, Sharding(m.tp, m.pp, m.moe_tp, m.moe_ep, p.attention_dp),
                          cfg.target, fmt=cfg.quantize.format,
                          dtype=None if cfg.model.dtype == "auto" else cfg.model.dtype,
                          gpus_per_pod=gpus, max_batch_size=b.max_batch_size,
                          max_seq_len=b.max_seq_len)


def python_instances(cfg: MoepipeConfig) -> int:
    """Python-model instances of the repository: pre/postprocessing and BLS, and the
    tensorrt_llm model itself where it is a Python model (``Target.python_model``)."""
    return 3 * cfg.deploy.instance_count + get_target(cfg.target).python_model


def plan(cfg: MoepipeConfig, version: str) -> tuple[k8s.PodPlan, k8s.Shape]:
    """The pods of release ``version`` (the build they serve: they read its repository,
    ``<deploy>/releases/<version>``)."""
    kc, d = cfg.deploy.k8s, cfg.deploy
    world = cfg.parallel.to_mapping().world_size
    shape = k8s.shape(cfg.target, world, kc.gpus_per_node)
    memory = pod_memory(cfg)
    startup = max(int(d.ready_timeout_s), get_target(cfg.target).min_startup_s)
    window = d.trtllm.expert_statistic
    env = {} if window is None else environment(window.start, window.stop,
                                                k8s.EXPERT_STATISTIC_DIR)
    paths = ServePaths.of(cfg)
    own = ServePaths.of(release_config(cfg, version))
    return k8s.PodPlan(
        name=k8s.check_name(kc.name, "deploy.k8s.name"), release=version,
        image=kc.image or default_image(cfg.target), target=cfg.target,
        serve_root=str(paths.serve_root),
        # the kubelet probes the pod IP and the Service forwards to it: the pod network is
        # the boundary
        server=ServerCommand.of(cfg, Path(own.repository()), host="0.0.0.0"),
        ports={"http": d.http_port, "grpc": d.grpc_port, "metrics": d.metrics_port},
        gpus=shape.gpus_per_pod, cpu=f"{kc.cpus:g}", memory_mib=memory,
        shm_mib=k8s.shm_mib(python_instances(cfg)), volume_claim=kc.volume_claim,
        startup_s=startup, exit_timeout_s=d.exit_timeout_s, rank_port=d.rank_port,
        env=tuple(env.items()), scratch=(k8s.EXPERT_STATISTIC_DIR,) if env else ()), shape


def render_operations(cfg: MoepipeConfig, out: Path, *, version: str,
                      model_dir: Path | None = None) -> list[Path]:
    """Write ``out/k8s`` (release ``version``, the build served; ``model_dir``: its source
    model, the validate Job's reference) and ``out/monitoring``; ``out`` is the deployment
    folder being written (the caller renames it into place when complete)."""
    pod, shape = plan(cfg, version)
    kc, mc = cfg.deploy.k8s, cfg.deploy.monitoring
    hpa_metric = monitoring.HPA_NAMES[kc.autoscale_metric]
    (out / "k8s").mkdir(parents=True)
    written = k8s.write(out / "k8s", pod, shape, namespace=kc.namespace,
                        min_replicas=kc.min_replicas, max_replicas=kc.max_replicas,
                        metric=hpa_metric, target=f"{kc.autoscale_target:g}")
    written += rollout.write(out / "k8s", cfg, pod, shape, model_dir=model_dir)
    mon = out / "monitoring"
    mon.mkdir()
    uid = grafana.dashboard_uid(pod.name)
    dashboard = json.dumps(grafana.dashboard(
        cfg.target, f"moepipe {pod.name} ({cfg.target})", uid,
        fallback=cfg.deploy.fallback is not None, decoupled=cfg.deploy.decoupled,
        expert_statistic=cfg.deploy.trtllm.expert_statistic is not None),
        indent=2) + "\n"
    rules = monitoring.rules(window_s=mc.rate_window_s, for_s=mc.alert_for_s,
                             slo_p99_ms=mc.slo_p99_ms, max_error_ratio=mc.max_error_ratio,
                             max_queue_ms=mc.max_queue_ms,
                             max_expert_imbalance=mc.max_expert_imbalance,
                             runbooks=mc.runbooks,
                             exported=exported(
                                 cfg.target, decoupled=cfg.deploy.decoupled,
                                 expert_statistic=cfg.deploy.trtllm.expert_statistic is not None),
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
            kc.autoscale_metric, mc.rate_window_s)),
        "grafana-dashboard.json": dashboard,
    }
    for name, text in files.items():
        (mon / name).write_text(text)
        written.append(mon / name)
    # In a cluster with the Prometheus Operator: the same rules and a PodMonitor.
    operator = out / "k8s" / "prometheus-operator"
    written += k8s.write_operator(operator, pod, rules, monitoring.JOB)
    # In a cluster with Grafana's dashboard sidecar: the dashboard as a labelled ConfigMap.
    written += k8s.write_folder(out / "k8s" / "grafana", {
        "dashboard-configmap.yaml": grafana.config_map(dashboard, uid, pod.name)})
    return written
