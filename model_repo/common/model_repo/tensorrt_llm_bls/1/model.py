"""moepipe tensorrt_llm_bls: the ensemble's text contract as one Python model.

Calls preprocessing -> tensorrt_llm -> postprocessing with BLS requests. In decoupled mode each
request runs on a worker thread so ``execute`` returns at once; with ``accumulate_tokens`` the
streamed text is decoded from all tokens so far (so multi-byte characters are never split).
Needs only numpy.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# client input -> (model, model input)
PRE_INPUTS = {"text_input": "QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
              "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
              "embedding_bias_words": "EMBEDDING_BIAS_WORDS",
              "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS", "end_id": "END_ID",
              "pad_id": "PAD_ID"}
PRE_TO_LLM = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths",
              "REQUEST_OUTPUT_LEN": "request_output_len", "OUT_END_ID": "end_id",
              "OUT_PAD_ID": "pad_id", "STOP_WORDS_IDS": "stop_words_list",
              "BAD_WORDS_IDS": "bad_words_list", "EMBEDDING_BIAS": "embedding_bias"}
LLM_INPUTS = {"exclude_input_in_output": "exclude_input_in_output", "top_k": "runtime_top_k",
              "top_p": "runtime_top_p", "temperature": "temperature",
              "length_penalty": "len_penalty", "repetition_penalty": "repetition_penalty",
              "min_tokens": "min_tokens", "presence_penalty": "presence_penalty",
              "frequency_penalty": "frequency_penalty", "seed": "seed",
              "return_log_probs": "return_log_probs",
              "return_num_input_tokens": "return_num_input_tokens",
              "return_num_output_tokens": "return_num_output_tokens",
              "beam_width": "beam_width", "num_return_sequences": "num_return_sequences",
              "stream": "streaming"}
PASS_THROUGH = ["cum_log_probs", "output_log_probs", "batch_index", "sequence_index",
                "num_input_tokens", "num_output_tokens"]


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
        self.llm = params.get("tensorrt_llm_model_name", "tensorrt_llm")
        self.accumulate = params.get("accumulate_tokens", "false").lower() == "true"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.pool = ThreadPoolExecutor(max_workers=64) if self.decoupled else None

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self.pool.submit(self._run, request, request.get_response_sender())
            return None
        responses = []
        for request in requests:
            sink = _Last()
            self._run(request, sink)
            responses.append(sink.response)
        return responses

    def _run(self, request, sender):
        try:
            for response in self._generate(request):
                sender.send(response)
            sender.send(flags=FINAL)
        except _Failed as e:
            sender.send(pb_utils.InferenceResponse(error=e.error), flags=FINAL)
        except Exception as e:  # keep the server up and tell the client
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=FINAL)

    def _generate(self, request):
        pre_in = [pb_utils.Tensor(dst, t.as_numpy()) for src, dst in PRE_INPUTS.items()
                  if (t := pb_utils.get_input_tensor_by_name(request, src)) is not None]
        pre = _check(pb_utils.InferenceRequest(
            model_name="preprocessing", inputs=pre_in,
            requested_output_names=list(PRE_TO_LLM)).exec())
        llm_in = [pb_utils.Tensor(dst, pb_utils.get_output_tensor_by_name(pre, src).as_numpy())
                  for src, dst in PRE_TO_LLM.items()]
        llm_in += [pb_utils.Tensor(dst, t.as_numpy()) for src, dst in LLM_INPUTS.items()
                   if (t := pb_utils.get_input_tensor_by_name(request, src)) is not None]
        llm_request = pb_utils.InferenceRequest(
            model_name=self.llm, inputs=llm_in,
            requested_output_names=["output_ids", "sequence_length", *PASS_THROUGH])
        stream = llm_request.exec(decoupled=True) if self.decoupled else [llm_request.exec()]
        tokens = []
        previous = ""
        for response in stream:
            if response.has_error():
                raise _Failed(response.error())
            ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if ids is None:  # a bare final flag
                continue
            lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy()
            new = ids.as_numpy().reshape(-1)[: int(lengths.reshape(-1)[0])]
            if self.accumulate:
                tokens += new.tolist()
                text = self._detokenize(np.array(tokens, np.int32))
                chunk, previous = text[len(previous):], text
            else:
                chunk = self._detokenize(new)
            out = [pb_utils.Tensor("text_output", np.array([[chunk.encode("utf-8")]], object))]
            out += [pb_utils.Tensor(name, t.as_numpy()) for name in PASS_THROUGH
                    if (t := pb_utils.get_output_tensor_by_name(response, name)) is not None]
            yield pb_utils.InferenceResponse(output_tensors=out)

    def _detokenize(self, ids):
        post = _check(pb_utils.InferenceRequest(
            model_name="postprocessing",
            inputs=[pb_utils.Tensor("TOKENS_BATCH", ids.reshape(1, 1, -1).astype(np.int32)),
                    pb_utils.Tensor("SEQUENCE_LENGTH", np.array([[ids.size]], np.int32))],
            requested_output_names=["OUTPUT"]).exec())
        text = pb_utils.get_output_tensor_by_name(post, "OUTPUT").as_numpy().reshape(-1)[0]
        return text.decode("utf-8") if isinstance(text, bytes) else str(text)

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


class _Last:
    """Keeps the last response (non-decoupled mode answers once)."""

    response = None

    def send(self, response=None, flags=0):
        if response is not None:
            self.response = response
