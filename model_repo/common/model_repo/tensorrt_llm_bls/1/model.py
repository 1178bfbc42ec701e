"""moepipe tensorrt_llm_bls: the ensemble's text contract as one Python model.

Calls preprocessing -> tensorrt_llm -> postprocessing with BLS requests, as TensorRT-LLM's
BLS does (triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/
triton_decoder.py): the whole batch goes to tensorrt_llm in one request, and every response of
tensorrt_llm becomes one response here, its text decoded by postprocessing (``text_output`` of
shape [beams]) and its other outputs (``batch_index``, logits, ...) passed on. In decoupled mode
each request runs on a worker thread so ``execute`` returns at once; with ``accumulate_tokens``
the streamed text is decoded from all tokens of the row so far (multi-byte characters are never
split). Needs only numpy. A composing model's error reaches this model as INTERNAL whatever its
code (the Python backend drops it); a busy refusal is passed on as UNAVAILABLE again
(``serving_core.triton.restore_code``).
"""

import json
import os
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overload  # noqa: E402 - beside this file; the model runs without moepipe installed
from serving_core.responses import FINAL, Last  # noqa: E402 - shipped beside this file
from serving_core.triton import (  # noqa: E402
    VERSION_PARAMETER,
    error_response,
    flag,
    parameters,
    request_parameters,
    restore_code,
)

# How often a decoupled request's client is asked whether it cancelled (or went away).
CANCEL_POLL_S = 0.25

# client input -> preprocessing input
PRE_INPUTS = {"text_input": "QUERY", "decoder_text_input": "DECODER_QUERY",
              "max_tokens": "REQUEST_OUTPUT_LEN", "bad_words": "BAD_WORDS_DICT",
              "stop_words": "STOP_WORDS_DICT", "embedding_bias_words": "EMBEDDING_BIAS_WORDS",
              "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS", "end_id": "END_ID",
              "pad_id": "PAD_ID", "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID"}
PRE_TO_LLM = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths",
              "REQUEST_OUTPUT_LEN": "request_output_len", "OUT_END_ID": "end_id",
              "OUT_PAD_ID": "pad_id", "STOP_WORDS_IDS": "stop_words_list",
              "BAD_WORDS_IDS": "bad_words_list", "EMBEDDING_BIAS": "embedding_bias"}
# client input -> tensorrt_llm input
LLM_INPUTS = {"exclude_input_in_output": "exclude_input_in_output", "top_k": "runtime_top_k",
              "top_p": "runtime_top_p", "temperature": "temperature",
              "length_penalty": "len_penalty", "repetition_penalty": "repetition_penalty",
              "min_tokens": "min_tokens", "presence_penalty": "presence_penalty",
              "frequency_penalty": "frequency_penalty", "seed": "seed",
              "return_log_probs": "return_log_probs",
              "return_context_logits": "return_context_logits",
              "return_generation_logits": "return_generation_logits",
              "return_perf_metrics": "return_perf_metrics",
              "return_num_input_tokens": "return_num_input_tokens",
              "return_num_output_tokens": "return_num_output_tokens",
              "beam_width": "beam_width", "num_return_sequences": "num_return_sequences",
              "stream": "streaming", "prompt_embedding_table": "prompt_embedding_table",
              "prompt_vocab_size": "prompt_vocab_size", "lora_task_id": "lora_task_id",
              "lora_weights": "lora_weights", "lora_config": "lora_config",
              "guided_decoding_guide_type": "guided_decoding_guide_type",
              "guided_decoding_guide": "guided_decoding_guide"}
PASS_THROUGH = ["cum_log_probs", "output_log_probs", "context_logits", "generation_logits",
                "batch_index", "sequence_index", "kv_cache_alloc_new_blocks",
                "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
                "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                "num_input_tokens", "num_output_tokens"]
# Inputs of TensorRT-LLM's BLS for models moepipe does not serve (multimodal, draft models).
UNSUPPORTED = {"image_input": "multimodal models", "image_bytes_input": "multimodal models",
               "image_url_input": "multimodal models", "video_bytes_input": "multimodal models"}


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = parameters(cfg)
        self.llm = params.get("tensorrt_llm_model_name", "tensorrt_llm")
        self.accumulate = flag(params.get("accumulate_tokens"))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.pool = ThreadPoolExecutor(max_workers=64) if self.decoupled else None
        self.policy = None
        if params.get("fallback_model_name"):
            router = overload.OverloadRouter(
                self.llm, params["fallback_model_name"],
                max_queue=int(params["fallback_max_queue"]),
                failures=int(params["fallback_failures"]),
                window_s=float(params["fallback_window_s"]),
                cooldown_s=float(params["fallback_cooldown_s"]))
            # Bad requests are the client's, not the primary's failures.
            self.policy = overload.FallbackPolicy(
                router, pb_utils, args["model_name"],
                is_server_error=lambda e: e.code() != pb_utils.TritonError.INVALID_ARG)

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self.pool.submit(self._run, request, request.get_response_sender())
            return None
        responses = []
        for request in requests:
            sink = Last()
            self._run(request, sink)
            responses.append(sink.response)
        return responses

    def _run(self, request, sender):
        # The model request carries an id, so that a client that cancels can be stopped there:
        # this Python backend cannot cancel a BLS request, but TensorRT-LLM's `stop` input
        # ends the running request with the same id.
        request_id = request.request_id() or f"moepipe-bls-{uuid.uuid4().hex}"
        done = threading.Event()
        if self.decoupled:
            threading.Thread(target=self._watch, args=(request_id, sender, done),
                             daemon=True).start()
        try:
            for response in self._generate(request, request_id):
                sender.send(response)
            sender.send(flags=FINAL)
        except _Failed as e:
            sender.send(pb_utils.InferenceResponse(error=restore_code(pb_utils, e.error)),
                        flags=FINAL)
        except Exception as e:  # a request moepipe refuses (ValueError) or a bug: the client
            sender.send(error_response(pb_utils, e), flags=FINAL)  # hears, the server lives
        finally:
            done.set()

    def _watch(self, request_id, sender, done):
        """Stop the model's request when the client cancels (or disconnects)."""
        while not done.wait(CANCEL_POLL_S):
            if sender.is_cancelled():
                stop = [pb_utils.Tensor("input_ids", np.zeros((1, 1), np.int32)),
                        pb_utils.Tensor("input_lengths", np.ones((1, 1), np.int32)),
                        pb_utils.Tensor("request_output_len", np.ones((1, 1), np.int32)),
                        pb_utils.Tensor("stop", np.ones((1, 1), np.bool_))]
                # With deploy.fallback the request may run on either model.
                models = [self.llm] + ([self.policy.router.fallback] if self.policy else [])
                for model in models:
                    try:
                        for _ in pb_utils.InferenceRequest(
                                model_name=model, inputs=stop, request_id=request_id,
                                requested_output_names=["output_ids"]).exec(decoupled=True):
                            pass
                    except Exception as e:  # the request may have ended meanwhile
                        pb_utils.Logger.log_warn(f"stopping a cancelled request failed: {e}")
                return

    def _generate(self, request, request_id):
        for name, what in UNSUPPORTED.items():
            if pb_utils.get_input_tensor_by_name(request, name) is not None:
                raise ValueError(f"{name} is for {what}, which moepipe does not serve")
        drafts = pb_utils.get_input_tensor_by_name(request, "num_draft_tokens")
        if drafts is not None and drafts.as_numpy().size and drafts.as_numpy().reshape(-1)[0]:
            raise ValueError("cannot perform speculative decoding without draft model")
        pre_in = [pb_utils.Tensor(dst, t.as_numpy()) for src, dst in PRE_INPUTS.items()
                  if (t := pb_utils.get_input_tensor_by_name(request, src)) is not None]
        pre = _check(pb_utils.InferenceRequest(
            model_name="preprocessing", inputs=pre_in,
            requested_output_names=list(PRE_TO_LLM)).exec())
        llm_in = [pb_utils.Tensor(dst, pb_utils.get_output_tensor_by_name(pre, src).as_numpy())
                  for src, dst in PRE_TO_LLM.items()]
        llm_in += [pb_utils.Tensor(dst, t.as_numpy()) for src, dst in LLM_INPUTS.items()
                   if (t := pb_utils.get_input_tensor_by_name(request, src)) is not None]

        # A request pinned to a weights version (a live update's validation) stays pinned on
        # its way to tensorrt_llm (python_backend: BLS requests take ``parameters`` since
        # src/pb_stub.cc gained the argument; only passed when there is one to pass).
        pinned = {k: v for k, v in request_parameters(request).items()
                  if k == VERSION_PARAMETER}
        extra = {"parameters": pinned} if pinned else {}

        def call(model):
            llm_request = pb_utils.InferenceRequest(
                model_name=model, inputs=llm_in, request_id=request_id,
                requested_output_names=["output_ids", "sequence_length", *PASS_THROUGH],
                **extra)
            return llm_request.exec(decoupled=True) if self.decoupled else [llm_request.exec()]

        stream = (self.policy.serve(call) if self.policy is not None
                  else ((self.llm, r) for r in call(self.llm)))
        tokens: dict[tuple[int, int], list[int]] = {}  # (batch, sequence) -> ids so far
        previous: dict[tuple[int, int], str] = {}
        for served_by, response in stream:
            if response.has_error():
                raise _Failed(response.error())
            ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if ids is None:  # a bare final flag
                continue
            passed = {name: t.as_numpy() for name in PASS_THROUGH
                      if (t := pb_utils.get_output_tensor_by_name(response, name)) is not None}
            ids = ids.as_numpy()
            lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy()
            if self.accumulate and ids.shape[1] == 1:
                key = (int(passed.get("batch_index", np.zeros(1)).reshape(-1)[0]),
                       int(passed.get("sequence_index", np.zeros(1)).reshape(-1)[0]))
                tokens[key] = tokens.get(key, []) + ids[0, 0, : int(lengths[0, 0])].tolist()
                text = self._detokenize(np.array([[tokens[key]]], np.int32),
                                        np.array([[len(tokens[key])]], np.int32))[0]
                old = previous.get(key, "")
                previous[key] = text
                text_output = np.array([text[len(old):].encode("utf-8")], dtype=object)
            else:
                text_output = np.array([t.encode("utf-8")
                                        for t in self._detokenize(ids, lengths)], dtype=object)
            out = [pb_utils.Tensor("text_output", text_output)]
            out += [pb_utils.Tensor(name, value) for name, value in passed.items()]
            out.append(pb_utils.Tensor("served_by", np.array([served_by.encode()], object)))
            yield pb_utils.InferenceResponse(output_tensors=out)

    def _detokenize(self, ids, lengths):
        post = _check(pb_utils.InferenceRequest(
            model_name="postprocessing",
            inputs=[pb_utils.Tensor("TOKENS_BATCH", ids.astype(np.int32)),
                    pb_utils.Tensor("SEQUENCE_LENGTH", lengths.astype(np.int32))],
            requested_output_names=["OUTPUT"]).exec())
        texts = pb_utils.get_output_tensor_by_name(post, "OUTPUT").as_numpy().reshape(-1)
        return [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in texts]

    def finalize(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class _Failed(Exception):
    def __init__(self, error):
        super().__init__(error.message())
        self.error = error


def _check(response):
    if response.has_error():
        raise _Failed(response.error())
    return response
