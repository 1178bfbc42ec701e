"""The ``tensorrt_llm`` model's tensor contract (TensorRT-LLM 1.2's Triton backend), without Triton.

How one Triton request's input tensors become per-row generation requests, and a row's result
becomes response tensors, as NVIDIA/TensorRT-LLM's backend does it:
``triton_backend/inflight_batcher_llm/src/utils.cc`` (``createRequestsFromInputTensors``),
``src/model_instance_state.cc`` (``enqueue``, ``handleStopRequest``, ``fillTritonResponse``) and
the Python variant ``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/1/model.py``.
Pure numpy, so unit tests run it without a server; the cpu target's Triton model calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moepipe.serving.request import RequestError

# Upstream's error texts (C++ backend), verbatim: clients see the same errors on every target.
ERR_BATCH_NOT_DECOUPLED = ("Batch size > 1 requires the tensorrt_llm backend to be using "
                           "decoupled transaction policy")
ERR_STREAMING_NOT_DECOUPLED = ("Streaming is only supported if model is deployed using "
                               "decoupled mode.")
ERR_STOP_WITHOUT_ID = "Trying to stop a request but request ID is not provided"

# Inputs TensorRT-LLM declares that the cpu target accepts (so Triton never answers "unexpected
# inference input") but cannot honour: a non-empty one is refused, naming what it is for.
UNSUPPORTED = {
    "encoder_input_features": "encoder-decoder models",
    "encoder_output_lengths": "encoder-decoder models",
    "decoder_input_ids": "encoder-decoder models",
    "decoder_input_lengths": "encoder-decoder models",
    "cross_attention_mask": "encoder-decoder models",
    "skip_cross_attn_blocks": "encoder-decoder models",
    "draft_input_ids": "speculative decoding",
    "draft_logits": "speculative decoding",
    "prompt_embedding_table": "prompt tuning (p-tuning / multimodal embeddings)",
    "prompt_table_extra_ids": "prompt tuning (p-tuning / multimodal embeddings)",
    "prompt_vocab_size": "prompt tuning (p-tuning / multimodal embeddings)",
    "mrope_rotary_cos_sin": "multimodal M-RoPE",
    "mrope_position_deltas": "multimodal M-RoPE",
    "lora_task_id": "LoRA adapters",
    "lora_weights": "LoRA adapters",
    "lora_config": "LoRA adapters",
    "context_phase_params": "disaggregated serving",
    "guided_decoding_guide_type": "guided decoding",
    "guided_decoding_guide": "guided decoding",
    "lookahead_window_size": "lookahead decoding",
    "lookahead_ngram_size": "lookahead decoding",
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
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: np.ndarray | None = None
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    return_perf_metrics: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


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


def parse(inputs: dict[str, np.ndarray], *, decoupled: bool,
          exclude_default: bool) -> list[Row]:
    """The rows of one request, validated as TensorRT-LLM's backend validates them."""
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
    for name, what in UNSUPPORTED.items():
        if name in t.arrays:
            raise RequestError(f"{name} is for {what}, which the cpu target does not support "
                               "(serve it on trtllm-engine)")
    if "request_output_len" not in t.arrays:
        raise RequestError("request_output_len is not present in the request")
    rows = []
    for b in range(batch):
        length = t.scalar("input_lengths", b, ids.shape[1], int)
        if not 0 <= length <= ids.shape[1]:
            raise RequestError(f"input_lengths {length} is outside 0..{ids.shape[1]} "
                               "(the length of input_ids)")
        streaming = bool(t.scalar("streaming", b, False, bool))
        if streaming and not decoupled:
            raise RequestError(ERR_STREAMING_NOT_DECOUPLED)
        beam = t.scalar("beam_width", b, 1, int)
        if beam != 1:
            raise RequestError(f"beam_width {beam}: beam search is not supported by the cpu "
                               "target (it is on trtllm-engine, build.max_beam_width)")
        num_seq = t.scalar("num_return_sequences", b, 1, int)
        if num_seq < 1:
            raise RequestError(f"num_return_sequences must be >= 1, got {num_seq}")
        decay = t.scalar("runtime_top_p_decay", b, 1.0)
        if decay != 1.0:
            raise RequestError("runtime_top_p_decay is not supported by the cpu target")
        bias = t.row("embedding_bias", b)
        rows.append(Row(
            batch_index=b,
            prompt=[int(x) for x in ids[b, :length]],
            max_new_tokens=t.scalar("request_output_len", b, 0, int),
            streaming=streaming,
            exclude_input=bool(t.scalar("exclude_input_in_output", b, exclude_default, bool)),
            end_id=t.scalar("end_id", b, None, int),
            pad_id=t.scalar("pad_id", b, None, int),
            beam_width=beam,
            num_return_sequences=num_seq,
            temperature=t.scalar("temperature", b, None, float),
            top_k=t.scalar("runtime_top_k", b, 0, int),
            top_p=t.scalar("runtime_top_p", b, 0.0, float),
            seed=t.scalar("seed", b, 0, int),
            min_tokens=t.scalar("min_tokens", b, 0, int),
            repetition_penalty=t.scalar("repetition_penalty", b, 1.0, float),
            presence_penalty=t.scalar("presence_penalty", b, 0.0, float),
            frequency_penalty=t.scalar("frequency_penalty", b, 0.0, float),
            stop_words=word_list(t.row("stop_words_list", b)),
            bad_words=word_list(t.row("bad_words_list", b)),
            embedding_bias=None if bias is None else bias.reshape(-1).astype(np.float32),
            return_log_probs=bool(t.scalar("return_log_probs", b, False, bool)),
            return_context_logits=bool(t.scalar("return_context_logits", b, False, bool)),
            return_generation_logits=bool(t.scalar("return_generation_logits", b, False,
                                                   bool)),
            return_perf_metrics=bool(t.scalar("return_perf_metrics", b, False, bool)),
            return_num_input_tokens=bool(t.scalar("return_num_input_tokens", b, False, bool)),
            return_num_output_tokens=bool(t.scalar("return_num_output_tokens", b, False,
                                                   bool))))
    return rows


@dataclass
class Result:
    """What one response of one row carries (tokens already with the prompt when included)."""

    tokens: list[int]
    log_probs: list[float] = field(default_factory=list)
    cum_log_prob: float = 0.0
    context_logits: np.ndarray | None = None  # [prompt_len, vocab]
    generation_logits: np.ndarray | None = None  # [steps, vocab]
    perf: dict[str, int | float] | None = None


PERF_OUTPUTS = {  # name -> numpy dtype (model_instance_state.cc processStats)
    "kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32,
    "kv_cache_alloc_total_blocks": np.int32, "arrival_time_ns": np.int64,
    "first_scheduled_time_ns": np.int64, "first_token_time_ns": np.int64,
    "last_token_time_ns": np.int64, "acceptance_rate": np.float32,
    "total_accepted_draft_tokens": np.int32, "total_draft_tokens": np.int32}


def response_arrays(row: Row, result: Result, *, batch_size: int, sequence_index: int,
                    logits_dtype=np.float32) -> dict[str, np.ndarray]:
    """Output tensors of one response, shaped as ``fillTritonResponse`` shapes them: a leading
    batch dimension of 1, then beams (always 1 here)."""
    n = len(result.tokens)
    out: dict[str, np.ndarray] = {
           "output_ids": np.array(result.tokens, np.int32).reshape(1, 1, n),
           "sequence_length": np.array([[n]], np.int32)}
    if row.return_log_probs:
        out["cum_log_probs"] = np.array([[result.cum_log_prob]], np.float32)
        out["output_log_probs"] = np.array(result.log_probs, np.float32).reshape(1, 1, -1)
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
        out["num_output_tokens"] = np.array([[n]], np.int32)
    if row.return_perf_metrics and result.perf is not None:
        for name, dtype in PERF_OUTPUTS.items():
            out[name] = np.array([[result.perf[name]]], dtype)
    return out
