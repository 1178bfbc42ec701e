"""TensorRT-LLM 1.2's Triton tensor contract, as pinned data for the tests.

Transcribed from NVIDIA/TensorRT-LLM ``triton_backend/all_models/inflight_batcher_llm/``
``tensorrt_llm/config.pbtxt``, ``ensemble/config.pbtxt`` and ``tensorrt_llm_bls/config.pbtxt``
(release/1.2 line). Each entry: name -> (data type, dims, optional). A data type written
``${...}`` is a placeholder of the upstream template: the logits one is rendered from
``build.logits_dtype`` (TYPE_FP32 / TYPE_FP16); the others upstream fills with TYPE_FP16.
Upstream's ensemble lists ``kv_cache_alloc_total_blocks`` twice; it is one output here.
"""

LOGITS = "${logits_datatype}"

_SCALAR = [1]

TENSORRT_LLM_INPUTS = {
    "input_ids": ("TYPE_INT32", [-1], True),
    "encoder_input_features": ("${encoder_input_features_data_type}", [-1, -1], True),
    "encoder_output_lengths": ("TYPE_INT32", _SCALAR, True),
    "input_lengths": ("TYPE_INT32", _SCALAR, False),
    "request_output_len": ("TYPE_INT32", _SCALAR, False),
    "num_return_sequences": ("TYPE_INT32", _SCALAR, True),
    "draft_input_ids": ("TYPE_INT32", [-1], True),
    "decoder_input_ids": ("TYPE_INT32", [-1], True),
    "decoder_input_lengths": ("TYPE_INT32", _SCALAR, True),
    "draft_logits": (LOGITS, [-1, -1], True),
    "draft_acceptance_threshold": ("TYPE_FP32", _SCALAR, True),
    "end_id": ("TYPE_INT32", _SCALAR, True),
    "pad_id": ("TYPE_INT32", _SCALAR, True),
    "stop_words_list": ("TYPE_INT32", [2, -1], True),
    "bad_words_list": ("TYPE_INT32", [2, -1], True),
    "embedding_bias": ("TYPE_FP32", [-1], True),
    "beam_width": ("TYPE_INT32", _SCALAR, True),
    "temperature": ("TYPE_FP32", _SCALAR, True),
    "runtime_top_k": ("TYPE_INT32", _SCALAR, True),
    "runtime_top_p": ("TYPE_FP32", _SCALAR, True),
    "runtime_top_p_min": ("TYPE_FP32", _SCALAR, True),
    "runtime_top_p_decay": ("TYPE_FP32", _SCALAR, True),
    "runtime_top_p_reset_ids": ("TYPE_INT32", _SCALAR, True),
    "len_penalty": ("TYPE_FP32", _SCALAR, True),
    "early_stopping": ("TYPE_BOOL", _SCALAR, True),
    "repetition_penalty": ("TYPE_FP32", _SCALAR, True),
    "min_tokens": ("TYPE_INT32", _SCALAR, True),
    "beam_search_diversity_rate": ("TYPE_FP32", _SCALAR, True),
    "presence_penalty": ("TYPE_FP32", _SCALAR, True),
    "frequency_penalty": ("TYPE_FP32", _SCALAR, True),
    "seed": ("TYPE_UINT64", _SCALAR, True),
    "return_log_probs": ("TYPE_BOOL", _SCALAR, True),
    "return_context_logits": ("TYPE_BOOL", _SCALAR, True),
    "return_generation_logits": ("TYPE_BOOL", _SCALAR, True),
    "return_perf_metrics": ("TYPE_BOOL", _SCALAR, True),
    "return_num_input_tokens": ("TYPE_BOOL", _SCALAR, True),
    "return_num_output_tokens": ("TYPE_BOOL", _SCALAR, True),
    "exclude_input_in_output": ("TYPE_BOOL", _SCALAR, True),
    "stop": ("TYPE_BOOL", _SCALAR, True),
    "streaming": ("TYPE_BOOL", _SCALAR, True),
    "prompt_embedding_table": ("${prompt_embedding_table_data_type}", [-1, -1], True),
    "prompt_table_extra_ids": ("TYPE_UINT64", [-1], True),
    "prompt_vocab_size": ("TYPE_INT32", _SCALAR, True),
    "cross_attention_mask": ("TYPE_BOOL", [-1, -1], True),
    "mrope_rotary_cos_sin": ("TYPE_FP32", [-1], True),
    "mrope_position_deltas": ("TYPE_INT64", _SCALAR, True),
    "lora_task_id": ("TYPE_UINT64", _SCALAR, True),
    "lora_weights": ("TYPE_FP16", [-1, -1], True),
    "lora_config": ("TYPE_INT32", [-1, 3], True),
    "context_phase_params": ("TYPE_UINT8", [-1], True),
    "skip_cross_attn_blocks": ("TYPE_BOOL", _SCALAR, True),
    "retention_token_range_starts": ("TYPE_INT32", [-1], True),
    "retention_token_range_ends": ("TYPE_INT32", [-1], True),
    "retention_token_range_priorities": ("TYPE_INT32", [-1], True),
    "retention_token_range_durations_ms": ("TYPE_INT32", [-1], True),
    "retention_decode_priority": ("TYPE_INT32", _SCALAR, True),
    "retention_decode_duration_ms": ("TYPE_INT32", _SCALAR, True),
    "guided_decoding_guide_type": ("TYPE_STRING", _SCALAR, True),
    "guided_decoding_guide": ("TYPE_STRING", _SCALAR, True),
    "lookahead_window_size": ("TYPE_INT32", _SCALAR, True),
    "lookahead_ngram_size": ("TYPE_INT32", _SCALAR, True),
    "lookahead_verification_set_size": ("TYPE_INT32", _SCALAR, True),
}

_PERF_OUTPUTS = {
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", _SCALAR),
    "kv_cache_reused_blocks": ("TYPE_INT32", _SCALAR),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", _SCALAR),
    "arrival_time_ns": ("TYPE_INT64", _SCALAR),
    "first_scheduled_time_ns": ("TYPE_INT64", _SCALAR),
    "first_token_time_ns": ("TYPE_INT64", _SCALAR),
    "last_token_time_ns": ("TYPE_INT64", _SCALAR),
    "acceptance_rate": ("TYPE_FP32", _SCALAR),
    "total_accepted_draft_tokens": ("TYPE_INT32", _SCALAR),
    "total_draft_tokens": ("TYPE_INT32", _SCALAR),
    "num_input_tokens": ("TYPE_INT32", _SCALAR),
    "num_output_tokens": ("TYPE_INT32", _SCALAR),
}

TENSORRT_LLM_OUTPUTS = {
    "output_ids": ("TYPE_INT32", [-1, -1]),
    "sequence_length": ("TYPE_INT32", [-1]),
    "cum_log_probs": ("TYPE_FP32", [-1]),
    "output_log_probs": ("TYPE_FP32", [-1, -1]),
    "context_logits": (LOGITS, [-1, -1]),
    "generation_logits": (LOGITS, [-1, -1, -1]),
    "batch_index": ("TYPE_INT32", _SCALAR),
    "sequence_index": ("TYPE_INT32", _SCALAR),
    "context_phase_params": ("TYPE_UINT8", [-1]),
    **_PERF_OUTPUTS,
}

ENSEMBLE_INPUTS = {
    "text_input": ("TYPE_STRING", _SCALAR, False),
    "decoder_text_input": ("TYPE_STRING", _SCALAR, True),
    "max_tokens": ("TYPE_INT32", _SCALAR, False),
    "num_return_sequences": ("TYPE_INT32", _SCALAR, True),
    "bad_words": ("TYPE_STRING", [-1], True),
    "stop_words": ("TYPE_STRING", [-1], True),
    "exclude_input_in_output": ("TYPE_BOOL", _SCALAR, True),
    "end_id": ("TYPE_INT32", _SCALAR, True),
    "pad_id": ("TYPE_INT32", _SCALAR, True),
    "top_k": ("TYPE_INT32", _SCALAR, True),
    "top_p": ("TYPE_FP32", _SCALAR, True),
    "temperature": ("TYPE_FP32", _SCALAR, True),
    "length_penalty": ("TYPE_FP32", _SCALAR, True),
    "repetition_penalty": ("TYPE_FP32", _SCALAR, True),
    "min_tokens": ("TYPE_INT32", _SCALAR, True),
    "presence_penalty": ("TYPE_FP32", _SCALAR, True),
    "frequency_penalty": ("TYPE_FP32", _SCALAR, True),
    "seed": ("TYPE_UINT64", _SCALAR, True),
    "return_log_probs": ("TYPE_BOOL", _SCALAR, True),
    "return_context_logits": ("TYPE_BOOL", _SCALAR, True),
    "return_generation_logits": ("TYPE_BOOL", _SCALAR, True),
    "return_perf_metrics": ("TYPE_BOOL", _SCALAR, True),
    "return_num_input_tokens": ("TYPE_BOOL", _SCALAR, True),
    "return_num_output_tokens": ("TYPE_BOOL", _SCALAR, True),
    "beam_width": ("TYPE_INT32", _SCALAR, True),
    "stream": ("TYPE_BOOL", _SCALAR, True),
    "prompt_embedding_table": ("TYPE_FP16", [-1, -1], True),
    "prompt_table_extra_id": ("TYPE_UINT64", _SCALAR, True),
    "prompt_vocab_size": ("TYPE_INT32", _SCALAR, True),
    "embedding_bias_words": ("TYPE_STRING", [-1], True),
    "embedding_bias_weights": ("TYPE_FP32", [-1], True),
    "lora_task_id": ("TYPE_UINT64", _SCALAR, True),
    "lora_weights": ("TYPE_FP16", [-1, -1], True),
    "lora_config": ("TYPE_INT32", [-1, 3], True),
    "guided_decoding_guide_type": ("TYPE_STRING", _SCALAR, True),
    "guided_decoding_guide": ("TYPE_STRING", _SCALAR, True),
}

TEXT_OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]),
    "cum_log_probs": ("TYPE_FP32", [-1]),
    "output_log_probs": ("TYPE_FP32", [-1, -1]),
    "context_logits": (LOGITS, [-1, -1]),
    "generation_logits": (LOGITS, [-1, -1, -1]),
    "batch_index": ("TYPE_INT32", _SCALAR),
    "sequence_index": ("TYPE_INT32", _SCALAR),
    **_PERF_OUTPUTS,
}

BLS_INPUTS = {
    **ENSEMBLE_INPUTS,
    "image_input": ("TYPE_FP16", [-1, 3, -1, -1], True),
    "image_bytes_input": ("TYPE_UINT8", [-1, -1, -1, -1], True),
    "image_url_input": ("TYPE_STRING", _SCALAR, True),
    "video_bytes_input": ("TYPE_UINT8", [-1, -1, -1, -1], True),
    "num_draft_tokens": ("TYPE_INT32", _SCALAR, True),
    "use_draft_logits": ("TYPE_BOOL", _SCALAR, True),
}

# model -> (inputs, outputs)
CONTRACT = {"tensorrt_llm": (TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS),
            "ensemble": (ENSEMBLE_INPUTS, TEXT_OUTPUTS),
            "tensorrt_llm_bls": (BLS_INPUTS, TEXT_OUTPUTS)}

# moepipe's additions, not upstream's: outputs a TensorRT-LLM client only sees if it asks for
# them. served_by: the model that answered (deploy.fallback; tensorrt_llm_bls/1/overload.py).
MOEPIPE_OUTPUTS = {"tensorrt_llm_bls": {"served_by": ("TYPE_STRING", _SCALAR)}}
