"""What a deployment target is: the one declaration of what it needs and supports.

A target is data, as a family is: the build stages its deployment is made from, the artifact
its ``tensorrt_llm`` model loads, whether it runs on GPUs and across nodes, the quantization
and KV-cache formats it serves, its container image and the metrics its deployment exports.
Code that differs between targets looks the answer up here (:func:`moepipe.targets.get_target`)
instead of comparing target names; the templates a target renders live in
``moepipe.deploy.render.targets``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from moepipe.arch.family import Family
    from moepipe.arch.spec import ModelSpec

# What the target's tensorrt_llm model loads: moepipe's TensorRT-LLM checkpoint (``convert``),
# TensorRT engines (``engine``) or the Hugging Face checkpoint itself (``hf``: the source, or
# the quantize stage's unified checkpoint).
Artifact = Literal["checkpoint", "engine", "hf"]
# Its container image: NVIDIA's Triton + TensorRT-LLM image of docker/versions.env, or
# moepipe's own image built on it (docker/Dockerfile: the model imports moepipe).
Image = Literal["triton", "moepipe"]


@dataclass(frozen=True)
class Target:
    name: str
    # Who serves the model, for messages ("... is not served by the <served_by>").
    served_by: str
    # The build stages its deployment is made from, in order (quantize and quality still
    # apply only to a quantized model).
    stages: tuple[str, ...]
    artifact: Artifact
    gpu: bool  # runs on NVIDIA GPUs (TensorRT-LLM); False: this machine's CPU
    # Its ranks may span nodes (MPI ranks, or moepipe's rank processes, over a
    # LeaderWorkerSet's pods).
    multi_node: bool
    # One tritonserver process per rank, joined by mpirun (TensorRT-LLM's leader mode); else
    # one server process (which may start its own workers).
    mpi_ranks: bool
    quant_formats: tuple[str, ...]  # quantize.format values it serves
    kv_cache_formats: tuple[str, ...]  # quantize.kv_cache values it serves
    image: Image
    # Its tensorrt_llm model is a Triton Python model (one more Python-backend instance, with
    # its shared memory); False: the C++ tensorrtllm backend.
    python_model: bool
    # Metric groups its deployment exports (moepipe.deploy.metric_names.GROUPS), given the
    # flags of every tritonserver moepipe starts (moepipe.deploy.tritonserver; GPU metrics
    # where the target runs on GPUs).
    metrics: tuple[str, ...]
    attention_dp: bool = False  # parallel.attention_dp (LLM API enable_attention_dp)
    expert_placement: bool = False  # deploy.trtllm.expert_placement (MoE load balancer)
    # deploy.trtllm.expert_statistic: TensorRT-LLM's PyTorch backend counts routed tokens
    # itself (EXPERT_STATISTIC_*; moepipe.trtllm.expert_statistic reads its files)
    expert_statistic: bool = False
    # What its moepipe_expert_tokens_total counts: "live" - every routed token since the model
    # started (rates are the current load); "window" - TensorRT-LLM's expert statistics of one
    # iteration window (deploy.trtllm.expert_statistic), exported once written, constant after,
    # with a ``window="START-STOP"`` label; None - no expert counts.
    expert_counts: Literal["live", "window"] | None = None
    # Its local deployment takes new weights of the same model while it serves (a live
    # update, moepipe.serving.live; world size 1); else a changed build restarts it.
    live_update: bool = False
    # The least time its pods get to load the model (GPU targets load for minutes).
    min_startup_s: int = 0

    @property
    def hf_layout(self) -> bool:
        """Its weights are read as the Hugging Face checkpoint stores them."""
        return self.artifact == "hf"

    @property
    def refusal(self) -> str:
        """How a model it cannot take is refused ("cannot be built for target ...")."""
        verb = "built for" if self.artifact == "engine" else "served by"
        return f"cannot be {verb} target {self.name}"

    def family_problem(self, family: Family, spec: ModelSpec | None = None) -> str | None:
        """Why this target cannot take ``family`` (given its ``spec``: this model of it), or
        None. The GPU targets serve what the pinned TensorRT-LLM serves: the engine path
        builds the architectures of ``tensorrt_llm/models/__init__.py`` ``MODEL_MAP``
        (``Family.no_engine`` / ``engine_problem`` say why not), the PyTorch backend loads
        the architectures of ``tensorrt_llm/_torch/models`` (``Family.no_pytorch``)."""
        if self.artifact == "engine":
            return family.no_engine if spec is None else family.engine_problem(spec)
        if self.artifact == "hf":
            return family.no_pytorch
        return None  # moepipe's runtime serves every registered family
