"""``moepipe.yaml``: one strict configuration model for every stage.

Unknown keys are errors; every error names the YAML path (and line), the bad value and the valid
choices. Relative paths are resolved against the folder of the YAML file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from moepipe.errors import ConfigError, MappingError
from moepipe.mapping import Mapping
from moepipe.targets import TargetName, get_target, quantization_problem, targets_where
from moepipe.utils.bounded import ReadError, read_file
from moepipe.utils.strictyaml import (
    CONFIG_LIMIT,
    StrictValueError,
    check_strict_scalar,
    decode_utf8,
    load_yaml,
)

DEFAULT_CONFIG = "moepipe.yaml"
DEFAULT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times,",
    "A Lion lay asleep in the forest, his great head resting on his paws.",
]
Target = TargetName  # the names of moepipe.targets' registry
Dtype = Literal["auto", "float32", "float16", "bfloat16"]

# The largest value of each kind of number moepipe.yaml holds: what the machine, Triton and
# TensorRT-LLM can honour. Every numeric field has a bound (a test walks the model), so no
# single value can exhaust a machine's processes, threads, memory or time (issue 26).
HOUR_S, DAY_S, WEEK_S = 3_600, 86_400, 7 * 86_400
HOUR_MS, DAY_MS, DAY_US = HOUR_S * 1000, DAY_S * 1000, DAY_S * 1_000_000
MAX_GPUS = 1024  # a parallel size (the widest expert-parallel deployments use a few hundred)
MAX_GPUS_PER_NODE = 64
MAX_CORES = 1024  # CPU cores of a pod
MAX_MEMORY_GIB = 16384  # of a GPU or a pod
MAX_TOKENS = 1 << 24  # a sequence, a step, a generation
MAX_KV_TOKENS = 1 << 32  # KV-cache tokens of a whole deployment
MAX_BATCH = 4096
MAX_BEAM = 1024
MAX_REQUESTS = 1 << 20  # requests of a job, queued requests, samples, kept iterations
MAX_WORKERS = 256  # processes a build stage starts
MAX_INSTANCES = 256  # Python-model instances (Triton starts a process for each)
MAX_THREADS = 1024  # torch threads of the cpu engine
PER_CORE = 4  # instance_count and cpu_threads: at most this many per core of the machine
MAX_CLIENT_PROCESSES = 64  # load-driver processes
MAX_INFLIGHT = 16384  # open requests of the load driver (a socket each)
MAX_USERS = 4096  # closed-loop users
MAX_RATE = 100_000.0  # requests/s
MAX_REPLICAS = 10_000
MAX_COUNT_TOKENS = 1 << 53
MAX_PATH = 1024  # characters of a path rendered into the deployment files
# The alerts' runbooks: sections of moepipe's README (deploy.monitoring.runbooks). moepipe has
# no published web address, so the default names the README itself; set an http(s) URL where a
# copy is served (a wiki, a mirror) for links an alert's reader can open.
RUNBOOKS = "README.md"
MAX_BINS = 100_000  # points of a timeline (burst: its seconds / bin_s)
Users = Annotated[int, Field(ge=1, le=MAX_USERS)]
Rate = Annotated[float, Field(gt=0, le=MAX_RATE)]


class Section(BaseModel):
    # allow_inf_nan=False: .inf and .nan are no timeout, rate or fraction (they passed and
    # failed later: a ready timeout of .inf waited forever)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        """Numbers and booleans are taken as written, in lists too: ``tp: true``,
        ``decoupled: 1`` or ``concurrency: [true, 2.0]`` are refused instead of becoming 1,
        True or [1, 2] (pydantic's lax mode would convert them)."""
        field = cls.model_fields.get(info.field_name or "")
        return value if field is None else check_strict_scalar(field.annotation, value)


class ModelSection(Section):
    path: Path | None = Field(None, description="Hugging Face checkpoint folder (safetensors).")
    example: str | None = Field(None, description="A built-in tiny example instead of a path.")
    dtype: Dtype = Field("auto", description="Weight dtype of the TensorRT-LLM checkpoint "
                                             "('auto' keeps the checkpoint's).")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the "
                                                       "checkpoint (off by default).")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.example is None):
            raise ValueError("set exactly one of 'path' or 'example'")
        if self.example is not None:
            from moepipe.examples import EXAMPLES

            if self.example not in EXAMPLES:
                raise ValueError(f"unknown example '{self.example}'; valid: "
                                 f"{', '.join(sorted(EXAMPLES))}")
        return self


class ParallelSection(Section):
    tp: int = Field(1, ge=1, le=MAX_GPUS, description="Tensor-parallel size.")
    pp: int = Field(1, ge=1, le=MAX_GPUS, description="Pipeline-parallel size.")
    moe_tp: int | None = Field(None, ge=1, le=MAX_GPUS,
                               description="MoE tensor-parallel size (default: derived, moe_tp * "
                                           "moe_ep = tp).")
    moe_ep: int | None = Field(None, ge=1, le=MAX_GPUS, description="MoE expert-parallel size.")
    attention_dp: bool = Field(False, description="trtllm-pytorch: attention data parallelism "
                               "(LLM API enable_attention_dp): attention weights replicated, "
                               "each of the tp ranks serves its own requests; needs tp > 1.")

    def to_mapping(self) -> Mapping:
        """The rank arithmetic of this section, unset MoE sizes resolved as TensorRT-LLM does
        (the one place a config becomes a :class:`~moepipe.mapping.Mapping`)."""
        return Mapping.create(tp=self.tp, pp=self.pp, moe_tp=self.moe_tp, moe_ep=self.moe_ep)


class ConvertSection(Section):
    workers: int = Field(1, ge=1, le=MAX_WORKERS, description="Ranks converted in parallel.")


QuantFormat = Literal["none", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4"]
KvCacheFormat = Literal["none", "fp8", "int8"]
# The validation jobs (moepipe.validate.registry.JOBS runs them; a test keeps the two equal).
JobName = Literal["smoke", "accuracy", "perf", "burst", "long-tail", "balance", "recovery",
                  "soak"]
GPU_ONLY_FORMATS = ("w4a8_awq", "nvfp4")


class CalibrationSection(Section):
    dataset: Path | None = Field(None, description="Text (.txt) or JSON-lines (.jsonl) file; "
                                                   "default: the corpus shipped with moepipe.")
    text_field: str = Field("text", description="The JSON-lines key holding the text.")
    samples: int = Field(32, ge=1, le=MAX_REQUESTS, description="Calibration sequences.")
    seq_len: int = Field(64, ge=8, le=MAX_TOKENS, description="Tokens per calibration sequence.")
    batch_size: int = Field(4, ge=1, le=MAX_BATCH,
                            description="Calibration sequences per forward pass.")
    eval_samples: int = Field(8, ge=1, le=MAX_REQUESTS,
                              description="Held-out sequences (after the calibration ones) on "
                                          "which quality is measured.")


class QualitySection(Section):
    """Quantization quality gates (None: measured and recorded, not enforced)."""

    min_top1_agreement: float | None = Field(None, ge=0, le=1, description="Fraction of "
                                             "positions whose top-1 token matches the "
                                             "unquantized model.")
    min_logit_cosine: float | None = Field(None, ge=-1, le=1, description="Mean cosine "
                                           "similarity of logits to the unquantized model's.")
    max_ppl_delta: float | None = Field(None, ge=0, le=1e6,
                                        description="Largest allowed increase of held-out "
                                                    "perplexity over the unquantized model's.")


class QuantizeSection(Section):
    format: QuantFormat = Field("none", description="Weight/activation format (modelopt). "
                                                    "w4a8_awq and nvfp4 need a GPU.")
    kv_cache: KvCacheFormat = Field("none", description="KV-cache quantization.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where each decoder layer is calibrated, one at a time ('auto': "
                            "the GPU when one is visible, else the CPU).")
    calibration: CalibrationSection = Field(default_factory=CalibrationSection,
                                            description="Calibration data.")
    quality: QualitySection = Field(default_factory=QualitySection,
                                    description="Quality gates of the quality stage.")


class PluginsSection(Section):
    """moepipe's custom plugins in the TensorRT-LLM engine (plugins/)."""

    router: Literal["trtllm", "moepipe"] = Field(
        "trtllm", description="Expert routing in the engine: 'trtllm' (TensorRT-LLM 1.2's own "
                              "routing ops) or 'moepipe' (the fused routing plugin, built "
                              "with moepipe-trtllm-build).")


class BuildSection(Section):
    """Serving limits: the engine is built for them (trtllm-engine) and the CPU runtime
    allocates its KV cache from them."""

    max_batch_size: int = Field(8, ge=1, le=4096, description="Requests batched together.")
    max_input_len: int = Field(1024, ge=1, le=MAX_TOKENS, description="Longest prompt, in tokens.")
    max_seq_len: int = Field(2048, ge=2, le=MAX_TOKENS,
                             description="Prompt + generated tokens, per request.")
    max_num_tokens: int = Field(8192, ge=1, le=MAX_TOKENS,
                                description="Tokens per engine step (trtllm).")
    # trtllm-engine: trtllm-build's other options (TensorRT-LLM 1.2's defaults) and the GPU
    # memory the pre-flight check of the limits assumes.
    max_beam_width: int = Field(1, ge=1, le=MAX_BEAM,
                                description="Widest beam the engine is built for "
                                            "(deploy.trtllm.max_beam_width <= this).")
    opt_num_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS,
                                       description="Tokens per step the engine is tuned for "
                                                   "(unset: max_batch_size x max_beam_width); not "
                                                   "together with multiple_profiles.")
    gemm_plugin: Literal["auto", "float16", "bfloat16", "float32", "fp8", "nvfp4",
                         "disable"] | None = Field(
        None, description="cuBLASLt GEMM plugin ('auto': the checkpoint's dtype; unset: "
                          "TensorRT-LLM's default, off except for NVFP4).")
    use_fused_mlp: bool = Field(True, description="Fuse the gated MLP's two GEMMs "
                                                  "(TensorRT-LLM turns it off for quantized "
                                                  "checkpoints other than FP8).")
    use_paged_context_fmha: bool = Field(True, description="Paged context attention; needed "
                                                           "by KV-cache reuse and chunked "
                                                           "context.")
    multiple_profiles: bool = Field(False, description="Several TensorRT optimisation "
                                                       "profiles (longer build, faster "
                                                       "engine); not with opt_num_tokens.")
    logits_dtype: Literal["float32", "float16"] = Field("float32", description="dtype of "
                                                        "the engine's logits.")
    workers: int = Field(1, ge=1, le=MAX_WORKERS,
                         description="Ranks trtllm-build builds in parallel (at most one per "
                                     "GPU).")
    plugins: PluginsSection = Field(default_factory=PluginsSection,
                                    description="moepipe's plugins in the engine.")
    gpu_memory_gb: float = Field(80, gt=0, le=MAX_MEMORY_GIB,
                                 description="Memory of one GPU in GiB (80 for an 80 GB H100), "
                                             "for the pre-flight check of these limits.")

    @model_validator(mode="after")
    def _input_fits(self):
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(f"max_input_len ({self.max_input_len}) must be smaller than "
                             f"max_seq_len ({self.max_seq_len})")
        return self


class ExpertStatisticSection(Section):
    """TensorRT-LLM's expert statistics (trtllm-pytorch): its workers count the experts they
    route for iterations start..stop-1, write the counts when iteration ``stop`` begins (once
    per server start), and the deployment exports them as ``moepipe_expert_tokens_total``.
    TensorRT-LLM runs without CUDA graphs while it counts."""

    start: int = Field(100, ge=0, le=MAX_REQUESTS, description="First iteration counted "
                       "(EXPERT_STATISTIC_ITER_RANGE START; early iterations are warm-up).")
    stop: int = Field(1100, ge=1, le=MAX_REQUESTS, description="Iteration at which the "
                      "counts are written (STOP, not counted).")

    @model_validator(mode="after")
    def _window(self):
        if self.start >= self.stop:
            raise ValueError(f"start ({self.start}) must be smaller than stop ({self.stop})")
        return self


class TrtllmDeploySection(Section):
    """Serving knobs of the GPU targets, with TensorRT-LLM 1.2's defaults. ``trtllm-engine``
    renders them as ``tensorrt_llm`` parameters, ``trtllm-pytorch`` as LLM-API arguments;
    a field that is None is left out (TensorRT-LLM then uses its own default)."""

    batching_strategy: Literal["inflight_fused_batching", "V1"] = Field(
        "inflight_fused_batching", description="trtllm-engine gpt_model_type: in-flight "
                                               "batching, or V1 (static batches).")
    batch_scheduler_policy: Literal["max_utilization", "guaranteed_no_evict"] = Field(
        "guaranteed_no_evict", description="guaranteed_no_evict never pauses a started "
                                           "request; max_utilization packs more requests.")
    max_beam_width: int = Field(1, ge=1, le=MAX_BEAM,
                                description="Widest beam a request may ask for (at most the "
                                            "engine's).")
    kv_cache_free_gpu_mem_fraction: float = Field(
        0.9, gt=0, le=1, description="Fraction of the GPU memory left after loading the "
                                     "weights that the KV cache may take.")
    max_tokens_in_paged_kv_cache: int | None = Field(None, ge=1, le=MAX_KV_TOKENS,
                                                     description="Cap on KV-cache tokens (unset: "
                                                                 "sized by the fraction alone).")
    max_attention_window_size: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Tokens attended per step (unset: max_seq_len).")
    enable_kv_cache_reuse: bool = Field(True, description="Reuse KV blocks of shared prompt "
                                                          "prefixes.")
    enable_chunked_context: bool = Field(False, description="Split long prompts into chunks "
                                                            "(chunked prefill).")
    normalize_log_probs: bool = Field(True, description="trtllm-engine: normalise "
                                                        "output_log_probs.")
    decoding_mode: Literal["top_k", "top_p", "top_k_top_p", "beam_search"] | None = Field(
        None, description="trtllm-engine (unset: top_k_top_p, or beam_search when "
                          "max_beam_width > 1).")
    cancellation_check_period_ms: int = Field(100, ge=1, le=HOUR_MS,
                                              description="trtllm-engine: how often cancelled "
                                                          "requests are looked for.")
    stats_check_period_ms: int = Field(
        100, ge=1, le=HOUR_MS, description="trtllm-engine: how often statistics are collected.")
    iter_stats_max_iterations: int = Field(
        1000, ge=0, le=MAX_REQUESTS, description="trtllm-engine: iterations of statistics kept.")
    request_stats_max_iterations: int = Field(0, ge=0, le=MAX_REQUESTS,
                                              description="trtllm-engine: iterations of "
                                                          "per-request statistics kept.")
    moe_backend: Literal["CUTLASS", "CUTEDSL", "WIDEEP", "TRTLLM", "DEEPGEMM", "VANILLA",
                         "TRITON"] = Field(
        "CUTLASS", description="trtllm-pytorch: moe_config.backend (CUTLASS: TensorRT-LLM "
                               "1.0's default).")
    expert_placement: Path | None = Field(
        None, description="trtllm-pytorch: a `moepipe balance` placement file, rendered as "
                          "moe_config.load_balancer (needs parallel.attention_dp, moe_ep >= 2 "
                          "and moe_backend WIDEEP).")
    expert_statistic: ExpertStatisticSection | None = Field(
        None, description="trtllm-pytorch: count routed experts over an iteration window "
                          "(TensorRT-LLM's EXPERT_STATISTIC_ITER_RANGE), exported as "
                          "moepipe_expert_tokens_total and read by `moepipe balance`; unset: "
                          "off.")


# Kubernetes names (k8s.io/apimachinery validation: IsDNS1123Label, IsDNS1123Subdomain) and
# image references; moepipe's object names get suffixes (-launch, -leader), hence 40 for name.
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = re.compile(_LABEL)
_NAMES: dict[str, tuple[re.Pattern[str], int, str]] = {
    "name": (DNS1123_LABEL, 40, "a DNS-1123 label (lower-case letters, digits, '-')"),
    "namespace": (DNS1123_LABEL, 63, "a DNS-1123 label (lower-case letters, digits, '-')"),
    "volume_claim": (re.compile(rf"{_LABEL}(\.{_LABEL})*"), 253,
                     "a DNS-1123 subdomain (lower-case letters, digits, '-', '.')"),
    "image": (re.compile(r"[\x21-\x7e]+"), 4096, "an image reference (no spaces)"),
}


class K8sSection(Section):
    """Kubernetes objects written to <deploy>/k8s (see moepipe.deploy.cluster.k8s)."""

    name: str = Field("moepipe", description="Name (and app label) of the Kubernetes objects.")
    namespace: str | None = Field(None, description="Namespace kustomize sets (unset: the "
                                                    "namespace kubectl applies to).")
    image: str | None = Field(None, description="Container image (unset: GPU targets use the "
                                                "Triton image of docker/versions.env; cpu "
                                                "uses moepipe-trtllm:<version>, built by "
                                                "docker/Dockerfile on that image).")
    volume_claim: str = Field("moepipe-work", description="PersistentVolumeClaim holding the "
                                                          "workdir; mounted at the workdir's "
                                                          "path.")
    gpus_per_node: int = Field(8, ge=1, le=MAX_GPUS_PER_NODE,
                               description="GPUs per node; a larger world size becomes a "
                                           "multi-node LeaderWorkerSet.")
    cpus: float = Field(4, gt=0, le=MAX_CORES, description="CPU cores requested per pod.")
    memory_gib: float | None = Field(None, gt=0, le=MAX_MEMORY_GIB,
                                     description="Memory per pod (unset: estimated from the "
                                                 "served weights and KV cache).")
    min_replicas: int = Field(1, ge=1, le=MAX_REPLICAS,
                              description="Replicas (LeaderWorkerSet: groups) the autoscaler "
                                          "keeps at least.")
    max_replicas: int = Field(4, ge=1, le=MAX_REPLICAS,
                              description="Replicas the autoscaler may add up to.")
    autoscale_metric: Literal["pending_requests", "queue_compute_ratio"] = Field(
        "pending_requests", description="HPA metric per pod (prometheus-adapter): Triton's "
                                        "queued requests, or queue time / compute time.")
    autoscale_target: float = Field(4, gt=0, le=1e6, description="Average value per pod the "
                                                         "autoscaler keeps the metric at.")

    @field_validator("name", "namespace", "volume_claim", "image")
    @classmethod
    def _kubernetes_names(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Names Kubernetes would refuse at apply time, refused here (fullmatch: a regex's
        ``$`` also matches before a final newline, and "moepipe\\n" passed)."""
        if value is None:
            return value
        rule, most, what = _NAMES[info.field_name or ""]
        if len(value) > most or not rule.fullmatch(value):
            raise ValueError(f"not {what} of at most {most} characters")
        return value

    @model_validator(mode="after")
    def _replicas(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas "
                             f"({self.min_replicas})")
        return self


class MonitoringSection(Section):
    """Prometheus scrape config, alert rules and Grafana dashboard in <deploy>/monitoring."""

    scrape_interval_s: int = Field(15, ge=1, le=HOUR_S, description="How often Prometheus scrapes.")
    evaluation_interval_s: int = Field(15, ge=1, le=HOUR_S, description="How often rules are "
                                                             "evaluated.")
    rate_window_s: int = Field(300, ge=1, le=WEEK_S,
                               description="Window of the rates the rules read.")
    alert_for_s: int = Field(600, ge=0, le=WEEK_S,
                             description="How long a condition holds before its alert fires.")
    slo_p99_ms: float = Field(5000, gt=0, le=DAY_MS, description="p99 request latency objective.")
    max_error_ratio: float = Field(0.01, ge=0, le=1, description="Failed / all requests.")
    max_queue_ms: float = Field(1000, gt=0, le=DAY_MS, description="Mean queue time per request.")
    max_expert_imbalance: float = Field(1.0, gt=0, le=1000,
                                        description="std/mean of the tokens per expert of a layer "
                                                    "(0 = even).")
    runbooks: str = Field(RUNBOOKS, description="The page whose sections are the alerts' "
                                                "runbooks (each alert's runbook_url is this + "
                                                "'#runbook-<alert name>'): moepipe's README "
                                                "(default), or the http(s) URL of a copy on "
                                                "your own wiki or mirror.")

    @field_validator("runbooks")
    @classmethod
    def _runbooks(cls, value: str) -> str:
        """An http(s) URL without a fragment (the alert's anchor is appended), or the default."""
        if value == RUNBOOKS:
            return value
        if len(value) > MAX_PATH or not re.fullmatch(r"https?://[\x21-\x7e]+", value) \
                or "#" in value:
            raise ValueError(f"not an http(s) URL of at most {MAX_PATH} characters without a "
                             "'#' fragment")
        return value


class FallbackSection(Section):
    """A second, smaller model the BLS model serves from while the primary is overloaded."""

    config: Path = Field(description="moepipe.yaml of the fallback pipeline (same target and "
                                     "tokenizer; `moepipe build` it first).")
    max_queue: int = Field(8, ge=0, le=MAX_REQUESTS,
                           description="Requests the primary may hold before the overflow goes to "
                                       "the fallback (0: no limit).")
    failures: int = Field(5, ge=1, le=MAX_REQUESTS,
                          description="Failed primary requests within window_s that open the "
                                      "circuit breaker.")
    window_s: float = Field(30, gt=0, le=DAY_S,
                            description="Window in which the failures are counted.")
    cooldown_s: float = Field(10, ge=0, le=DAY_S,
                              description="Open time before one probe request tries the primary "
                                          "again.")


class DeploySection(Section):
    output: Path | None = Field(None, description="Deployment folder (default <workdir>/deploy):"
                                                  " model_repo/, tokenizer/, launch files.")
    host: str = Field("127.0.0.1", description="Address the server binds (loopback by default).")
    http_port: int = Field(8000, ge=1, le=65535, description="Triton HTTP port.")
    grpc_port: int = Field(8001, ge=1, le=65535, description="Triton gRPC port.")
    metrics_port: int = Field(8002, ge=1, le=65535, description="Prometheus metrics port.")
    rank_port: int = Field(8003, ge=1, le=65535, description="cpu target, world size > 1: the "
                                                             "port rank 0 (in the server) "
                                                             "listens on for the other ranks.")
    collective_timeout_s: float = Field(60.0, gt=0, le=DAY_S,
                                        description="cpu target, world size > 1: "
                                        "a collective of a step that takes longer fails the "
                                        "rank group (a lost rank is noticed at once anyway).")
    decoupled: bool = Field(True, description="Decoupled transaction policy (needed for "
                                              "streaming; gRPC clients then use the stream API).")
    exclude_input_in_output: bool = Field(False, description="Default of the request input of "
                                          "that name: true returns only generated tokens "
                                          "(TensorRT-LLM's default: false, the prompt too).")
    add_special_tokens: bool = Field(True, description="Tokenizer adds BOS/EOS like "
                                                       "tokenizer(text) does.")
    skip_special_tokens: bool = Field(True, description="Detokenizer drops special tokens "
                                                        "(BOS/EOS/PAD) from text_output.")
    accumulate_tokens: bool = Field(True, description="BLS streaming decodes all tokens so far.")
    max_queue_delay_microseconds: int = Field(0, ge=0, le=DAY_US,
                                              description="How long Triton may hold a request to "
                                                          "batch it with others.")
    max_queue_size: int = Field(64, ge=0, le=MAX_REQUESTS,
                                description="Requests that may wait for the engine (Triton's "
                                            "default_queue_policy; TensorRT-LLM's executor and "
                                            "the cpu engine bound their queue of requests waiting "
                                            "for a slot by it too); more are refused at once as "
                                            "busy (UNAVAILABLE: \"Exceeds maximum queue size\"). 0 "
                                            "= unlimited (Triton's and TensorRT-LLM's default).")
    queue_timeout_microseconds: int = Field(0, ge=0, le=DAY_US,
                                            description="A request that waited this long for the "
                                                        "engine is refused as busy (\"Request "
                                                        "timeout expired\"; Triton's "
                                                        "default_timeout_microseconds; the cpu "
                                                        "engine's slot queue too). 0 = no limit.")
    instance_count: int = Field(1, ge=1, le=MAX_INSTANCES,
                                description="Pre/postprocessing and BLS instances.")
    cpu_threads: int = Field(1, ge=1, le=MAX_THREADS,
                             description="torch threads of the cpu target's engine.")
    ready_timeout_s: float = Field(180.0, gt=0, le=DAY_S,
                                   description="How long deploy waits for ready.")
    exit_timeout_s: int = Field(30, ge=1, le=HOUR_S,
                                description="Grace period for in-flight requests.")
    max_restarts: int = Field(3, ge=0, le=1000,
                              description="cpu target: times the supervisor restarts a server "
                                          "whose process or a model process died, or a rank "
                                          "group that lost a rank (0: only stop it).")
    serve_root: Path | None = Field(None, description="Where the workdir is when the "
                                    "deployment is served (another machine's or a container's "
                                    "folder, e.g. /models; default: the workdir itself): the "
                                    "absolute paths a backend needs (trtllm-engine's engine, "
                                    "launch.sh, the pods' repository) are rendered under it and "
                                    "the Kubernetes pods mount the workdir's volume there. "
                                    "Python models find their files relative to the "
                                    "repository.")
    tritonserver: Path | None = Field(None, description="tritonserver binary (default: PATH, "
                                                        "else the one in nvidia-pytriton).")
    trtllm: TrtllmDeploySection = Field(default_factory=TrtllmDeploySection,
                                        description="GPU targets' TensorRT-LLM serving knobs.")
    k8s: K8sSection = Field(default_factory=K8sSection,
                            description="Kubernetes objects written to <deploy>/k8s.")
    fallback: FallbackSection | None = Field(None, description="Overload fallback model "
                                                               "(BLS model only).")
    monitoring: MonitoringSection = Field(default_factory=MonitoringSection,
                                          description="Prometheus rules, scrape config and "
                                                      "Grafana dashboard in "
                                                      "<deploy>/monitoring.")

    @field_validator("serve_root")
    @classmethod
    def _serve_root(cls, value: Path | None) -> Path | None:
        """An absolute path the rendered files can quote; not resolved (it names the serving
        machine's folder, not one of this machine)."""
        if value is None:
            return value
        text = str(value)
        if len(text) > MAX_PATH:
            raise ValueError(f"must be a path of at most {MAX_PATH} characters")
        if not value.is_absolute() or text == "/":
            raise ValueError(f"{text!r} must be an absolute path below / (where the workdir "
                             "is when served, e.g. /models)")
        if ".." in value.parts:
            raise ValueError(f"{text!r} must be a normalised path (no '..')")
        bad = sorted(set('"\\`$\n\r\t\'') & set(text))
        if bad:
            raise ValueError(f"{text!r} contains {' '.join(map(repr, bad))}, which the "
                             "rendered files cannot quote")
        return value

    @model_validator(mode="after")
    def _distinct_ports(self):
        ports = [self.http_port, self.grpc_port, self.metrics_port, self.rank_port]
        if len(set(ports)) != 4:
            raise ValueError(f"http_port, grpc_port, metrics_port and rank_port must differ, "
                             f"got {ports}")
        return self

    def check_machine(self, cores: int) -> None:
        """Refuse Python-model instances and engine threads that a machine of ``cores`` cores
        cannot run (:data:`PER_CORE` per core): each instance is a process of its own with
        its shared memory, each thread a thread; a million of either took the machine down.
        Checked where the cpu target starts on this machine (``moepipe deploy``)."""
        limit = PER_CORE * cores
        for key in ("instance_count", "cpu_threads"):
            value = getattr(self, key)
            if value > limit:
                raise ConfigError(f"deploy.{key}: {value} is more than this machine's {cores} "
                                  f"core(s) can run (at most {PER_CORE} per core: {limit})",
                                  f"set deploy.{key} to at most {limit}, or deploy on a "
                                  "larger machine")


class SloSection(Section):
    """Service-level objectives the ``perf`` job checks at every load point (unset: measured
    and reported, not enforced)."""

    ttft_p99_ms: float | None = Field(None, gt=0, le=DAY_MS, description="p99 time to first token.")
    latency_p99_ms: float | None = Field(None, gt=0, le=DAY_MS, description="p99 request latency.")
    itl_p99_ms: float | None = Field(None, gt=0, le=DAY_MS, description="p99 inter-token latency.")
    min_output_tokens_per_s: float | None = Field(None, gt=0, le=1e9, description="Output tokens/s "
                                                  "(the server's own counts).")
    max_error_rate: float | None = Field(0.0, ge=0, le=1, description="Share of requests "
                                         "rejected, failed or timed out.")


class LoadSection(Section):
    """moepipe's load driver, shared by the load jobs."""

    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS, description="Tokens generated per request.")
    processes: int = Field(1, ge=1, le=MAX_CLIENT_PROCESSES,
                           description="Client processes (raise when one core saturates: the jobs "
                                       "report client CPU).")
    max_inflight: int = Field(128, ge=1, le=MAX_INFLIGHT,
                              description="Open loop: requests in flight at most; more arrivals "
                                          "are counted as not sent.")
    request_timeout_s: float = Field(30.0, gt=0, le=DAY_S, description="Per request.")


class PerfSection(Section):
    concurrency: list[Users] = Field([1, 4], description="Closed-loop users per point.")
    rates: list[Rate] = Field([4.0], description="Open-loop (Poisson) requests/s per point.")
    requests: int = Field(24, ge=1, le=MAX_REQUESTS, description="Requests per point (at most).")
    duration_s: float = Field(20.0, gt=0, le=DAY_S, description="Seconds per point (at most).")

    @model_validator(mode="after")
    def _some_point(self):
        if not self.concurrency and not self.rates:  # a sweep of nothing passes vacuously
            raise ValueError("concurrency and rates are both empty: perf would measure nothing")
        return self


class BurstSection(Section):
    base_rate: float = Field(2.0, gt=0, le=MAX_RATE,
                             description="Requests/s before and after the burst.")
    factor: float = Field(5.0, ge=1, le=1000, description="Burst rate = factor x base_rate.")
    before_s: float = Field(6.0, gt=0, le=DAY_S,
                            description="Seconds at base rate before the burst.")
    burst_s: float = Field(6.0, gt=0, le=DAY_S, description="Seconds of the burst.")
    after_s: float = Field(8.0, gt=0, le=DAY_S, description="Seconds at base rate after the burst.")
    bin_s: float = Field(1.0, gt=0, le=DAY_S, description="Timeline resolution.")
    tolerance: float = Field(1.5, ge=1, le=1000, description="p99 counts as recovered within this "
                                                    "factor of the pre-burst p99.")
    max_recovery_s: float | None = Field(None, gt=0, le=DAY_S,
                                         description="Gate: seconds after the burst until p99 is "
                                                     "back within tolerance.")

    @model_validator(mode="after")
    def _timeline(self):
        """The job keeps a row per bin of its timeline: bin_s: 1e-6 made 20 million of them."""
        seconds = self.before_s + self.burst_s + self.after_s
        if seconds / self.bin_s > MAX_BINS:
            raise ValueError(f"bin_s {self.bin_s:g} cuts the job's {seconds:g} s into more than "
                             f"{MAX_BINS} bins; use bin_s >= {seconds / MAX_BINS:.3g}")
        return self


class LongTailSection(Section):
    rate: float = Field(3.0, gt=0, le=MAX_RATE, description="Requests/s.")
    duration_s: float = Field(8.0, gt=0, le=DAY_S, description="Seconds per phase (without, with).")
    long_share: float = Field(0.1, gt=0, lt=1, description="Share of long prompts.")
    long_prompt_tokens: int = Field(200, ge=8, le=MAX_TOKENS,
                                    description="Tokens of a long prompt (capped by "
                                                "build.max_input_len).")
    max_short_p99_ratio: float | None = Field(None, ge=1, le=1000,
                                              description="Gate: short-request p99 with long "
                                                          "prompts / without.")


class BalanceSection(Section):
    requests: int = Field(24, ge=1, le=MAX_REQUESTS,
                          description="Requests sent between the two scrapes.")
    concurrency: int = Field(4, ge=1, le=MAX_USERS, description="Closed-loop users sending them.")
    duration_s: float = Field(60.0, gt=0, le=DAY_S, description="Seconds of traffic at most.")
    min_tokens: int = Field(500, ge=1, le=MAX_COUNT_TOKENS,
                            description="Layers that routed fewer tokens are not judged.")
    max_std_over_mean: float | None = Field(None, gt=0, le=1000,
                                            description="Gate per layer: std/mean of the expert "
                                                        "load (off by default: random-weight "
                                                        "models are not balanced).")


class RecoverySection(Section):
    kill: list[Literal["rank", "server", "backend"]] = Field(
        ["rank", "server", "backend"], min_length=1,
        description="What is killed (SIGKILL), in turn: a worker rank (world size > 1; "
                    "skipped otherwise), the server, the tensorrt_llm backend process.")
    rate: float = Field(2.0, gt=0, le=MAX_RATE, description="Requests/s during the job.")
    warmup_s: float = Field(3.0, gt=0, le=DAY_S, description="Load before the kill.")
    after_s: float = Field(3.0, ge=0, le=DAY_S, description="Load after the deadline.")
    max_seconds: float = Field(60.0, gt=0, le=DAY_S, description="Gate: kill -> first successful "
                                                       "response.")


class SoakSection(Section):
    """A steady load held for a long time: errors, latency drift, and the trends of the
    deployment's memory and KV use (a leak is a trend that would pass its bound over the
    run)."""

    seconds: float = Field(1800, gt=0, le=WEEK_S, description="Length of the steady load (a "
                                                              "day: 86400).")
    rate: float = Field(2.0, gt=0, le=MAX_RATE, description="Requests/s, Poisson arrivals.")
    window_s: float = Field(60, gt=0, le=DAY_S, description="Latency window: drift compares "
                            "the first with the last; the trends leave out the first (warm-up).")
    sample_s: float = Field(5, gt=0, le=HOUR_S,
                            description="How often memory and KV use are sampled.")
    drain_s: float = Field(30, gt=0, le=HOUR_S, description="After the load: how long KV use "
                           "may take to return to its idle level.")
    max_error_rate: float = Field(0.001, ge=0, le=1, description="Gate: share of requests "
                                  "rejected, failed, timed out or not sent.")
    max_memory_growth_mib: float = Field(256, gt=0, le=MAX_MEMORY_GIB * 1024,
                                         description="Gate: growth of the deployment's RSS over "
                                         "the run, from its trend after the warm-up.")
    max_kv_growth: float = Field(0.05, gt=0, le=1, description="Gate: growth of KV use over "
                                 "the run, from its trend after the warm-up, as a share of the "
                                 "KV capacity.")
    max_p99_drift: float | None = Field(None, ge=1, le=1e6, description="Gate: p99 latency of "
                                        "the last window / the first (unset: reported only).")

    @model_validator(mode="after")
    def _two_windows(self):
        if self.seconds / self.sample_s > MAX_BINS:
            raise ValueError(f"seconds / sample_s ({self.seconds:g} / {self.sample_s:g}) is more "
                             f"than {MAX_BINS} samples; use sample_s >= "
                             f"{self.seconds / MAX_BINS:.3g}")
        if self.seconds < 2 * self.window_s:
            raise ValueError(f"seconds ({self.seconds:g}) must hold at least two windows of "
                             f"window_s ({self.window_s:g}): drift compares the first with "
                             "the last")
        return self


class CostSection(Section):
    """The deployment's price, for US$ per million tokens (the perf job, the Prometheus rules):
    the price of what the validated endpoint runs on (one replica)."""

    usd_per_hour: float | None = Field(None, gt=0, le=1e7, description="US$ per hour of the "
                                       "deployment (one replica, all its machines).")
    usd_per_gpu_hour: float | None = Field(None, gt=0, le=1e4, description="GPU targets: US$ "
                                           "per GPU and hour; the deployment's price is this x "
                                           "its GPUs (tp x pp).")
    max_usd_per_million_tokens: float | None = Field(
        None, gt=0, le=1e9, description="US$ per million tokens (input and output counted "
                                        "alike) above which the MoepipeCostPerTokenHigh alert "
                                        "fires and the perf job fails (at its cheapest load "
                                        "point).")

    @model_validator(mode="after")
    def _one_price(self):
        if self.usd_per_hour is not None and self.usd_per_gpu_hour is not None:
            raise ValueError("give usd_per_hour or usd_per_gpu_hour, not both")
        if self.max_usd_per_million_tokens is not None and self.usd_per_hour is None \
                and self.usd_per_gpu_hour is None:
            raise ValueError("max_usd_per_million_tokens needs a price (usd_per_hour or "
                             "usd_per_gpu_hour)")
        return self


class ValidateSection(Section):
    url: str | None = Field(None, description="HTTP endpoint (default: the local deployment).")
    grpc_url: str | None = Field(None, description="gRPC endpoint host:port.")
    metrics_url: str | None = Field(None, description="Prometheus metrics host:port (default: "
                                                      "the local deployment's).")
    jobs: list[JobName] = Field(["smoke", "accuracy"], min_length=1,
                                description="Jobs `moepipe validate` runs.")
    prompts: list[str] = Field(default_factory=lambda: list(DEFAULT_PROMPTS), min_length=1,
                               description="Prompts the smoke and accuracy jobs send.")
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS,
                            description="Tokens generated per validation request.")
    min_token_agreement: float = Field(
        1.0, ge=0, le=1, description="accuracy: fraction of greedy tokens that must equal "
                                     "Hugging Face's (1.0 = identical, right for float32).")
    timeout_s: float = Field(120.0, gt=0, le=DAY_S, description="Per-request timeout of validation "
                                                      "requests, in seconds.")
    slo: SloSection = Field(default_factory=SloSection, description="perf: latency and "
                                                                    "throughput objectives.")
    load: LoadSection = Field(default_factory=LoadSection, description="The load driver "
                                                                       "of the load jobs.")
    perf: PerfSection = Field(default_factory=PerfSection, description="perf: the sweep.")
    burst: BurstSection = Field(default_factory=BurstSection, description="burst: the step.")
    long_tail: LongTailSection = Field(default_factory=LongTailSection,
                                       description="long-tail: the long-prompt mix.")
    balance: BalanceSection = Field(default_factory=BalanceSection,
                                    description="balance: traffic and the expert-load gate.")
    recovery: RecoverySection = Field(default_factory=RecoverySection,
                                      description="recovery: kills and the time gate.")
    soak: SoakSection = Field(default_factory=SoakSection,
                              description="soak: the long steady load and its gates.")
    cost: CostSection = Field(default_factory=CostSection,
                              description="The deployment's price: US$ per million tokens.")


class MoepipeConfig(Section):
    model: ModelSection = Field(description="The model: a checkpoint folder or an example.")
    target: Target = Field("cpu", description="Where the model is served: moepipe's "
                                                  "runtime in a local Triton (cpu), TensorRT "
                                                  "engines, or TensorRT-LLM's PyTorch backend.")
    parallel: ParallelSection = Field(default_factory=ParallelSection,
                                      description="Tensor / pipeline / expert parallel mapping.")
    convert: ConvertSection = Field(default_factory=ConvertSection,
                                    description="The checkpoint converter.")
    quantize: QuantizeSection = Field(default_factory=QuantizeSection,
                                      description="Post-training quantization (modelopt).")
    build: BuildSection = Field(default_factory=BuildSection,
                                description="Serving limits and trtllm-build options.")
    deploy: DeploySection = Field(default_factory=DeploySection,
                                  description="The Triton deployment.")
    # `validate` would shadow pydantic's BaseModel.validate; the YAML key is still `validate`.
    validation: ValidateSection = Field(default_factory=ValidateSection, alias="validate",
                                        description="Validation jobs against the endpoint.")
    workdir: Path = Field(Path("moepipe-work"), description="Where build outputs, logs and "
                                                             "reports go.")

    # Set by load_config(): the file this config came from.
    _source: Path | None = PrivateAttr(None)

    @property
    def source(self) -> Path | None:
        return self._source

    def resolve_paths(self, base: Path) -> MoepipeConfig:
        if self.model.path is not None and not self.model.path.is_absolute():
            self.model.path = (base / self.model.path).resolve()
        if not self.workdir.is_absolute():
            self.workdir = (base / self.workdir).resolve()
        if self.deploy.output is not None and not self.deploy.output.is_absolute():
            self.deploy.output = (base / self.deploy.output).resolve()
        placement = self.deploy.trtllm.expert_placement
        if placement is not None and not placement.is_absolute():
            self.deploy.trtllm.expert_placement = (base / placement).resolve()
        fb = self.deploy.fallback
        if fb is not None and not fb.config.is_absolute():
            fb.config = (base / fb.config).resolve()
        cal = self.quantize.calibration
        if cal.dataset is not None and not cal.dataset.is_absolute():
            cal.dataset = (base / cal.dataset).resolve()
        return self

    @model_validator(mode="after")
    def _target_supports_quantization(self):
        q = self.quantize
        if q.kv_cache != "none" and q.format == "none":
            raise ValueError("quantize.kv_cache needs a weight format too (quantize.format: "
                             "fp8, int8_sq or int4_awq); KV-cache-only quantization is not "
                             "supported yet")
        problem = quantization_problem(self.target, q.format, q.kv_cache)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _attention_dp_and_placement(self):
        p, t, target = self.parallel, self.deploy.trtllm, get_target(self.target)
        if p.attention_dp and not target.attention_dp:
            able = targets_where(lambda o: o.attention_dp)
            raise ValueError(f"parallel.attention_dp is a "
                             f"{' / '.join(get_target(n).served_by for n in able)} feature; "
                             f"set target: {' or '.join(able)} or attention_dp: false")
        if p.attention_dp and p.tp < 2:
            raise ValueError("parallel.attention_dp needs tp >= 2 (the attention data-parallel "
                             "ranks are the tp ranks)")
        if t.expert_placement is not None:
            try:
                ep = p.to_mapping().moe_ep  # tp: 4, moe_tp: 1 is moe_ep 4, unset or not
            except MappingError as e:
                raise ValueError(str(e)) from None
            if not target.expert_placement or not p.attention_dp or ep < 2 \
                    or t.moe_backend != "WIDEEP":
                able = " or ".join(targets_where(lambda o: o.expert_placement))
                raise ValueError("deploy.trtllm.expert_placement is TensorRT-LLM's MoE load "
                                 f"balancer: it needs target {able}, "
                                 "parallel.attention_dp: true, parallel.moe_ep >= 2 and "
                                 "deploy.trtllm.moe_backend: WIDEEP")
        return self

    @model_validator(mode="after")
    def _validation_fits_the_build(self):
        """Tokens a validation request asks for fit what the deployment serves (a prompt of at
        least one token + the generated ones <= build.max_seq_len): the accuracy job
        generates as many in transformers for its reference, server up or not."""
        limit = self.build.max_seq_len - 1
        v = self.validation
        for key, value in (("validate.max_tokens", v.max_tokens),
                           ("validate.load.max_tokens", v.load.max_tokens)):
            if value > limit:
                raise ValueError(f"{key} is {value}; the build serves at most {limit} "
                                 f"generated tokens (build.max_seq_len {self.build.max_seq_len}"
                                 " minus a prompt token)")
        return self

    @model_validator(mode="after")
    def _expert_statistic_target(self):
        if self.deploy.trtllm.expert_statistic is not None \
                and not get_target(self.target).expert_statistic:
            able = " or ".join(targets_where(lambda t: t.expert_statistic))
            raise ValueError("deploy.trtllm.expert_statistic is TensorRT-LLM's PyTorch-backend "
                             f"statistics; set target: {able} (the cpu target exports expert "
                             "counts by itself)")
        return self

    @model_validator(mode="after")
    def _gpu_price(self):
        if self.validation.cost.usd_per_gpu_hour is not None and not get_target(self.target).gpu:
            raise ValueError(f"validate.cost.usd_per_gpu_hour prices GPUs; the {self.target} "
                             "target has none: give validate.cost.usd_per_hour")
        return self

    def usd_per_hour(self) -> float | None:
        """The deployment's price per hour (``validate.cost``), GPUs counted as tp x pp."""
        c = self.validation.cost
        if c.usd_per_gpu_hour is not None:
            return c.usd_per_gpu_hour * self.parallel.to_mapping().world_size
        return c.usd_per_hour

    @property
    def expert_statistic_dir(self) -> Path:
        """Where a local trtllm-pytorch server's TensorRT-LLM writes its expert statistics
        (beside the deployment folder, which `moepipe deploy` replaces)."""
        return self.workdir / "expert-statistic"

    @property
    def deploy_dir(self) -> Path:
        return self.deploy.output or self.workdir / "deploy"


def field_info(key: str) -> tuple[str, tuple[str, ...]]:
    """(description, choices) of a dotted YAML key such as ``quantize.format``; choices are the
    values a Literal field takes (empty for other fields). The CLI builds its help from this."""
    import typing

    model: type[BaseModel] = MoepipeConfig
    field = None
    for part in key.split("."):
        field = _keys(model)[part]
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
    if field is None:
        raise KeyError(key)
    literal = [a for a in (field.annotation, *typing.get_args(field.annotation))
               if typing.get_origin(a) is Literal]
    choices = tuple(str(c) for c in typing.get_args(literal[0])) if literal else ()
    return field.description or "", choices


def field_help(key: str) -> str:
    """Help text of a CLI option that sets ``key``: its description (the CLI lists a Literal
    field's choices itself: its option takes the field's own type)."""
    return field_info(key)[0]


def _line_of(text: str, loc: tuple) -> int | None:
    """Line number (1-based) of a key path in YAML text, best effort."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == str(part):
                    line, node = key.start_mark.line + 1, value
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _keys(model: type[BaseModel]) -> dict[str, Any]:
    """YAML key -> field of a section (aliases where a field has one)."""
    return {(f.alias or name): f for name, f in model.model_fields.items()}


def _describe(err: dict[str, Any], model: type[BaseModel]) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") \
        or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        parent: type[BaseModel] | None = model
        for part in loc[:-1]:
            field = _keys(parent).get(str(part)) if parent is not None else None
            ann = field.annotation if field else None
            parent = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        valid = f"; valid keys: {', '.join(_keys(parent))}" if parent else ""
        return f"{path}: unknown key{valid}"
    if kind == "literal_error":
        choices = err["msg"].replace("Input should be", "choose")
        return f"{path}: {err['input']!r} is not valid; {choices}"
    if kind == "missing":
        return f"{path}: required"
    strict = (err.get("ctx") or {}).get("error")
    if isinstance(strict, StrictValueError):  # names the list item; says what it got
        return f"{path}{strict.where}: {strict.why}"
    msg = err["msg"].removeprefix("Value error, ")
    if "input" not in err or isinstance(err.get("input"), dict):
        return f"{path}: {msg}"
    got = repr(err["input"])
    return f"{path}: {msg} (got {got if len(got) <= 60 else got[:40] + '...'})"


def parse_config(data: Any, source: str = "<config>", text: str | None = None) -> MoepipeConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(data).__name__}",
                          "see `moepipe init` for a commented example")
    try:
        return MoepipeConfig.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        first = errors[0]
        where = source
        if text is not None:
            line = _line_of(text, tuple(first["loc"]))
            if line:
                where = f"{source}:{line}"
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise ConfigError(f"{where}: {_describe(dict(first), MoepipeConfig)}{more}",
                          "fix the value or run `moepipe init --force` for a fresh file") from None


def workdir_of(path: str | Path | None = None) -> Path | None:
    """The workdir a config file names, read loosely (to stop a deployment whose config has
    become invalid since): its ``workdir:`` line, else the default."""
    import re

    path = Path(path or DEFAULT_CONFIG)
    try:
        text = read_file(path, CONFIG_LIMIT, "config file").decode("utf-8", errors="replace")
    except ReadError:
        return None
    m = re.search(r"^workdir:[ \t]*['\"]?([^'\"#\n]+?)['\"]?[ \t]*(#.*)?$", text, re.M)
    workdir = Path(m.group(1).strip()) if m else Path("moepipe-work")
    return workdir if workdir.is_absolute() else path.resolve().parent / workdir


def load_config(path: str | Path | None = None) -> MoepipeConfig:
    path = Path(path or DEFAULT_CONFIG)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file",
                          "run `moepipe init --example tiny-mixtral` (or --model DIR) first, "
                          "or pass -c FILE")
    text = decode_utf8(path)
    try:
        data = load_yaml(text, str(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    cfg = parse_config(data, str(path), text)
    cfg._source = path.resolve()
    return cfg.resolve_paths(path.resolve().parent)
