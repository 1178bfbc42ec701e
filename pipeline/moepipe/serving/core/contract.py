"""The ``tensorrt_llm`` model's tensor contract (TensorRT-LLM 1.2's Triton backend), without Triton.

How one Triton request's input tensors become per-row generation requests, and a row's result
becomes response tensors, as NVIDIA/TensorRT-LLM's backend does it:
``triton_backend/inflight_batcher_llm/src/utils.cc`` (``createRequestsFromInputTensors``),
``src/model_instance_state.cc`` (``enqueue``, ``handleStopRequest``, ``fillTritonResponse``) and
the Python variant ``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/1/model.py``.
What an engine behind a Python model can honour is declared per target (``Features``): an
input it cannot honour is refused by name instead of being ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import (  # noqa: F401 (the contract)
    ERR_BATCH_NOT_DECOUPLED,
    ERR_STOP_WITHOUT_ID,
    ERR_STREAMING_NOT_DECOUPLED,
    RequestError,
)

_ENCODER = "encoder-decoder models"
_DRAFT = "speculative decoding"
_PTUNING = "prompt tuning (p-tuning / multimodal embeddings)"
_LORA = "LoRA adapters"
# Inputs TensorRT-LLM declares that the cpu target accepts (so Triton never answers "unexpected
# inference input") but cannot honour: a non-empty one is refused, naming what it is for.
UNSUPPORTED = {
    "encoder_input_features": _ENCODER, "encoder_output_lengths": _ENCODER,
    "decoder_input_ids": _ENCODER, "decoder_input_lengths": _ENCODER,
    "cross_attention_mask": _ENCODER, "skip_cross_attn_blocks": _ENCODER,
    "draft_input_ids": _DRAFT, "draft_logits": _DRAFT,
    "prompt_embedding_table": _PTUNING, "prompt_table_extra_ids": _PTUNING,
    "prompt_vocab_size": _PTUNING,
    "mrope_rotary_cos_sin": "multimodal M-RoPE", "mrope_position_deltas": "multimodal M-RoPE",
    "lora_task_id": _LORA, "lora_weights": _LORA, "lora_config": _LORA,
    "context_phase_params": "disaggregated serving",
    "guided_decoding_guide_type": "guided decoding", "guided_decoding_guide": "guided decoding",
    "lookahead_window_size": "lookahead decoding", "lookahead_ngram_size": "lookahead decoding",
    "lookahead_verification_set_size": "lookahead decoding",
}
# Accepted and without effect here, as in TensorRT-LLM when their feature is off: beam-search
# knobs with beam_width 1, the draft threshold without draft tokens, KV-cache retention
# priorities (the cpu target keeps one cache slot per request and reuses no blocks).
NO_EFFECT = ("len_penalty", "early_stopping", "beam_search_diversity_rate",
             "draft_acceptance_threshold", "runtime_top_p_min", "runtime_top_p_reset_ids",
             "retention_token_range_starts", "retention_token_range_ends",
             "retention_token_range_priorities", "retention_token_range_durations_ms",
             "retention_decode_priority", "retention_decode_duration_ms")


@dataclass(frozen=True)
class Features:
    """What the engine behind a Python ``tensorrt_llm`` model honours."""

    target: str
    unsupported: dict[str, str]  # input -> what it is for; refused when given (non-empty)
    beam_search: bool = False
    streaming_beams: bool = False  # streaming with beam_width > 1
    return_sequences: bool = True  # num_return_sequences > 1
    top_p_decay: bool = False  # runtime_top_p_decay != 1


# The reference runtime (moepipe.runtime): one beam, every output of the contract.
CPU = Features("cpu", UNSUPPORTED)
# TensorRT-LLM's LLM API as the trtllm-pytorch model drives it: beams, but no logits or perf
# metrics mapped from its results, and one sequence per request.
TRTLLM_PYTORCH = Features("trtllm-pytorch", {
    **UNSUPPORTED, "return_context_logits": "context logits",
    "return_generation_logits": "generation logits",
    "return_perf_metrics": "per-request perf metrics"},
    beam_search=True, return_sequences=False)


@dataclass
class Row:
    """One row of a (possibly batched) request: TensorRT-LLM's ``executor::Request``."""

    batch_index: int
    prompt: list[int]
    max_new_tokens: int
    streaming: bool = False
    exclude_input: bool = False
    end_id: int | None = None
    pad_id: int | None = None
    beam_width: int = 1
    num_return_sequences: int = 1
    temperature: float | None = None
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    len_penalty: float | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: np.ndarray | None = None
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    return_perf_metrics: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    given: frozenset[str] = frozenset()  # the inputs the request set (a default is not "set")


def is_stop(inputs: dict[str, np.ndarray]) -> bool:
    """A ``stop`` request cancels the running request with the same request id."""
    stop = inputs.get("stop")
    return stop is not None and stop.size > 0 and bool(stop.reshape(-1)[0])


def word_list(arr: np.ndarray | None) -> list[list[int]]:
    """``[2, n]`` (ids row; cumulative end offsets row, -1 padded) -> list of token-id words."""
    if arr is None or arr.size == 0:
        return []
    ids, offsets = arr.reshape(2, -1).tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            continue
        if end > len(ids):
            raise RequestError("Invalid format for word list.")
        words.append(ids[start:end])
        start = end
    return [w for w in words if w]


class _Inputs:
    """Input tensors of one request, row by row; a zero-size tensor counts as absent."""

    def __init__(self, inputs: dict[str, np.ndarray], batch_size: int):
        self.batch_size = batch_size
        self.arrays = {k: np.asarray(v) for k, v in inputs.items() if np.asarray(v).size}
        if batch_size == 1:  # a bare scalar of a one-row request is that row's value
            self.arrays = {k: v.reshape(1) if v.ndim == 0 else v for k, v in self.arrays.items()}
        for name, arr in self.arrays.items():
            if arr.ndim == 0 or arr.shape[0] != batch_size:
                got = arr.shape[0] if arr.ndim else 0
                raise RequestError(f"Expected batch size doesn't match batch size for tensor "
                                   f"{name}. Expected {batch_size} got {got}")

    def row(self, name: str, b: int) -> np.ndarray | None:
        arr = self.arrays.get(name)
        return None if arr is None else arr[b]

    def scalar(self, name: str, b: int, default=None, kind=float):
        arr = self.row(name, b)
        if arr is None or arr.size == 0:
            return default
        if arr.size != 1:
            raise RequestError(f"Expected a scalar tensor for tensor {name}")
        return kind(arr.reshape(-1)[0])


def _refuse_unhonoured(t: _Inputs, features: Features, decoupled: bool) -> None:
    for name, what in features.unsupported.items():
        if name in t.arrays and (t.arrays[name].dtype != np.bool_ or t.arrays[name].any()):
            raise RequestError(f"{name} is not supported by the {features.target} target: it "
                               f"is for {what} (serve it on trtllm-engine)")
    for b in range(t.batch_size):
        beam = t.scalar("beam_width", b, 1, int)
        if beam < 1:
            raise RequestError(f"beam_width must be >= 1, got {beam}")
        if beam > 1 and not features.beam_search:
            raise RequestError(f"beam_width {beam}: beam search is not supported by the "
                               f"{features.target} target (it is on trtllm-engine, "
                               "build.max_beam_width)")
        if beam > 1 and t.scalar("streaming", b, False, bool) and not features.streaming_beams:
            raise RequestError(f"streaming with beam_width {beam} is not supported by the "
                               f"{features.target} target")
        sequences = t.scalar("num_return_sequences", b, 1, int)
        if sequences < 1:
            raise RequestError(f"num_return_sequences must be >= 1, got {sequences}")
        if sequences > 1 and not features.return_sequences:
            raise RequestError(f"num_return_sequences > 1 is not supported by the "
                               f"{features.target} target")
        if sequences > 1 and not decoupled:
            raise RequestError("num_return_sequences > 1 sends one response per sequence, "
                               "which needs decoupled mode (deploy.decoupled: true)")
        if t.scalar("runtime_top_p_decay", b, 1.0) != 1.0 and not features.top_p_decay:
            raise RequestError(f"runtime_top_p_decay is not supported by the "
                               f"{features.target} target")


def parse(inputs: dict[str, np.ndarray], *, decoupled: bool, exclude_default: bool,
          features: Features = CPU) -> list[Row]:
    """The rows of one request, validated as TensorRT-LLM's backend validates them; what
    ``features`` does not honour is refused by name."""
    ids = inputs.get("input_ids")
    if ids is None or np.asarray(ids).size == 0:
        raise RequestError("input_ids is not present in the request.")
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise RequestError("Invalid format for input_ids")
    batch = ids.shape[0]
    if batch > 1 and not decoupled:
        raise RequestError(ERR_BATCH_NOT_DECOUPLED)
    t = _Inputs(inputs, batch)
    if "request_output_len" not in t.arrays:
        raise RequestError("request_output_len is not present in the request")
    _refuse_unhonoured(t, features, decoupled)
    given = frozenset(t.arrays)
    rows = []
    for b in range(batch):
        length = t.scalar("input_lengths", b, ids.shape[1], int)
        if not 0 <= length <= ids.shape[1]:
            raise RequestError(f"input_lengths {length} is outside 0..{ids.shape[1]} "
                               "(the length of input_ids)")
        streaming = bool(t.scalar("streaming", b, False, bool))
        if streaming and not decoupled:
            raise RequestError(ERR_STREAMING_NOT_DECOUPLED)
        bias = t.row("embedding_bias", b)

        def flag(name, default=False, b=b):
            return bool(t.scalar(name, b, default, bool))

        rows.append(Row(
            batch_index=b,
            prompt=[int(x) for x in ids[b, :length]],
            max_new_tokens=t.scalar("request_output_len", b, 0, int),
            streaming=streaming,
            exclude_input=flag("exclude_input_in_output", exclude_default),
            end_id=t.scalar("end_id", b, None, int),
            pad_id=t.scalar("pad_id", b, None, int),
            beam_width=t.scalar("beam_width", b, 1, int),
            num_return_sequences=t.scalar("num_return_sequences", b, 1, int),
            temperature=t.scalar("temperature", b, None, float),
            top_k=t.scalar("runtime_top_k", b, 0, int),
            top_p=t.scalar("runtime_top_p", b, 0.0, float),
            seed=t.scalar("seed", b, 0, int),
            min_tokens=t.scalar("min_tokens", b, 0, int),
            repetition_penalty=t.scalar("repetition_penalty", b, 1.0, float),
            presence_penalty=t.scalar("presence_penalty", b, 0.0, float),
            frequency_penalty=t.scalar("frequency_penalty", b, 0.0, float),
            len_penalty=t.scalar("len_penalty", b, None, float),
            stop_words=word_list(t.row("stop_words_list", b)),
            bad_words=word_list(t.row("bad_words_list", b)),
            embedding_bias=None if bias is None else bias.reshape(-1).astype(np.float32),
            return_log_probs=flag("return_log_probs"),
            return_context_logits=flag("return_context_logits"),
            return_generation_logits=flag("return_generation_logits"),
            return_perf_metrics=flag("return_perf_metrics"),
            return_num_input_tokens=flag("return_num_input_tokens"),
            return_num_output_tokens=flag("return_num_output_tokens"),
            given=given))
    return rows


@dataclass(frozen=True)
class Sampling:
    """How a row samples, as TensorRT-LLM reads its inputs."""

    temperature: float  # 0: greedy
    top_k: int  # 0: no top-k filter
    top_p: float  # 1.0: no top-p filter
    seed: int


def sampling(row: Row, sequence: int = 0) -> Sampling:
    """TensorRT-LLM decodes greedily unless runtime_top_k > 1 or runtime_top_p > 0 asks for
    sampling (temperature 0 or top_k 1 is greedy as well); temperature defaults to 1. Each
    returned sequence samples its own stream (seed + its index)."""
    seed = row.seed + sequence
    if row.top_k == 0 and row.top_p <= 0:
        return Sampling(0.0, 0, 1.0, seed)
    temperature = 1.0 if row.temperature is None else row.temperature
    return Sampling(temperature, row.top_k, row.top_p if row.top_p > 0 else 1.0, seed)


@dataclass
class Result:
    """What one response of one row carries (tokens already with the prompt when included).
    With beam search, ``beams`` holds every beam's (tokens, log_probs, cum_log_prob); the
    fields above are then beam 0's."""

    tokens: list[int]
    log_probs: list[float] = field(default_factory=list)
    cum_log_prob: float = 0.0
    context_logits: np.ndarray | None = None  # [prompt_len, vocab]
    generation_logits: np.ndarray | None = None  # [steps, vocab]
    perf: dict[str, int | float] | None = None
    beams: list[tuple[list[int], list[float], float]] | None = None


PERF_OUTPUTS = {  # name -> numpy dtype (model_instance_state.cc processStats)
    "kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32,
    "kv_cache_alloc_total_blocks": np.int32, "arrival_time_ns": np.int64,
    "first_scheduled_time_ns": np.int64, "first_token_time_ns": np.int64,
    "last_token_time_ns": np.int64, "acceptance_rate": np.float32,
    "total_accepted_draft_tokens": np.int32, "total_draft_tokens": np.int32}


def _padded(rows: list[list], pad, dtype) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    return np.array([[r + [pad] * (width - len(r)) for r in rows]], dtype).reshape(
        1, len(rows), width)


def response_arrays(row: Row, result: Result, *, batch_size: int, sequence_index: int,
                    logits_dtype=np.float32) -> dict[str, np.ndarray]:
    """Output tensors of one response, shaped as ``fillTritonResponse`` shapes them: a leading
    batch dimension of 1, then beams (beams shorter than the longest are padded with the
    request's pad id, else 0)."""
    beams = result.beams or [(result.tokens, result.log_probs, result.cum_log_prob)]
    out: dict[str, np.ndarray] = {
        "output_ids": _padded([list(b[0]) for b in beams], row.pad_id or 0, np.int32),
        "sequence_length": np.array([[len(b[0]) for b in beams]], np.int32)}
    if row.return_log_probs:
        out["cum_log_probs"] = np.array([[b[2] for b in beams]], np.float32)
        out["output_log_probs"] = _padded([list(b[1]) for b in beams], 0.0, np.float32)
    if result.context_logits is not None:
        out["context_logits"] = result.context_logits.astype(logits_dtype)[None]
    if result.generation_logits is not None:
        out["generation_logits"] = result.generation_logits.astype(logits_dtype)[None, None]
    if batch_size > 1:
        out["batch_index"] = np.array([[row.batch_index]], np.int32)
    if row.num_return_sequences > 1:
        out["sequence_index"] = np.array([[sequence_index]], np.int32)
    if row.return_num_input_tokens:
        out["num_input_tokens"] = np.array([[len(row.prompt)]], np.int32)
    if row.return_num_output_tokens:  # every id in output_ids, as upstream counts them
        out["num_output_tokens"] = np.array([[len(beams[0][0])]], np.int32)
    if row.return_perf_metrics and result.perf is not None:
        for name, dtype in PERF_OUTPUTS.items():
            out[name] = np.array([[result.perf[name]]], dtype)
    return out
