"""What Triton core reports for which server flags, as pinned data for the tests.

Read from triton-inference-server (server at 0299e63, core at 6370c43, the 24.x line the images
of docker/versions.env ship):
* server ``src/command_line_parser.cc``: ``--metrics-config <setting>=<value>`` (repeatable,
  one global group), ``--allow-metrics``, ``--allow-gpu-metrics`` (``allow_gpu_metrics &=
  allow_metrics``);
* core ``src/metric_model_reporter.cc`` (``MetricReporterConfig::ParseConfig``,
  ``Initialize{Counters,Gauges,Histograms,Summaries}``): success / failure / count /
  exec_count counters and the pending-request gauge always; the latency counters unless
  ``counter_latencies=false``; the ``*_summary_us`` families only with
  ``summary_latencies=true``; ``nv_inference_first_response_histogram_ms`` only with
  ``histogram_latencies=true`` and only for decoupled models;
* core ``src/metrics.cc``: the family names, the DCGM ``nv_gpu_*`` / ``nv_energy_consumption``
  gauges (GPU metrics, on a machine with GPUs) and the ``nv_cpu_*`` ones.
"""

COUNTERS = {"nv_inference_request_success", "nv_inference_request_failure",
            "nv_inference_count", "nv_inference_exec_count",
            "nv_inference_pending_request_count"}
LATENCY_COUNTERS = {f"nv_inference_{k}_duration_us"
                    for k in ("request", "queue", "compute_input", "compute_infer",
                              "compute_output")}
SUMMARIES = {f"nv_inference_{k}_summary_us{s}"
             for k in ("request", "queue", "compute_input", "compute_infer", "compute_output")
             for s in ("", "_sum", "_count")}
FIRST_RESPONSE = {f"nv_inference_first_response_histogram_ms{s}"
                  for s in ("_bucket", "_sum", "_count")}
CPU = {"nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"}
GPU = {"nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
       "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption"}


def triton_reports(args: list[str], *, gpus: bool, decoupled: bool = True) -> set[str]:
    """Triton core's metric names for a server started with ``args`` (see the module
    docstring for the upstream files)."""
    flags: dict[str, str] = {}
    settings: dict[str, str] = {}
    for arg in args:
        name, _, value = arg.removeprefix("--").partition("=")
        if name == "metrics-config":
            key, _, setting = value.partition("=")
            settings[key] = setting
        else:
            flags[name] = value
    if flags.get("allow-metrics", "true") == "false":
        return set()
    names = COUNTERS | CPU
    if settings.get("counter_latencies") != "false":
        names |= LATENCY_COUNTERS
    if settings.get("summary_latencies") == "true":
        names |= SUMMARIES
    if settings.get("histogram_latencies") == "true" and decoupled:
        names |= FIRST_RESPONSE
    if gpus and flags.get("allow-gpu-metrics", "true") != "false":
        names |= GPU
    return names


def triton_part(names: set[str]) -> set[str]:
    """The names Triton core reports (not a backend's, a model's or Prometheus' own)."""
    return {n for n in names if n.startswith("nv_")
            and not n.startswith(("nv_trt_llm_", "nv_llm_"))}
