"""moepipe preprocessing: text -> token ids, with TensorRT-LLM's tensor contract.

Needs only numpy and transformers (runs in NVIDIA's Triton containers as well as locally).
Stop/bad words and embedding-bias words are comma-separated strings; word lists are encoded as
TensorRT-LLM expects: ``[2, n]`` INT32, row 0 the concatenated ids, row 1 the cumulative end
offsets padded with -1.
"""

import csv
import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


def _bool(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes")


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"],
                                                       trust_remote_code=False)
        self.add_special_tokens = _bool(params.get("add_special_tokens", "false"))
        self.vocab_size = int(params.get("vocab_size") or len(self.tokenizer))
        self.end_id = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.end_id

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._one(request)))
            except ValueError as e:
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses

    def _one(self, request):
        query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)
        text = query[0].decode("utf-8") if isinstance(query[0], bytes) else str(query[0])
        if not text:
            raise ValueError("the prompt (text_input) is empty")
        ids = self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens)
        if not ids:
            raise ValueError("the prompt (text_input) encodes to no tokens")
        out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy()
        end_id = self._scalar(request, "END_ID", self.end_id)
        pad_id = self._scalar(request, "PAD_ID", self.pad_id)
        return [
            pb_utils.Tensor("INPUT_ID", np.array([ids], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(ids)]], dtype=np.int32)),
            pb_utils.Tensor("BAD_WORDS_IDS", self._words(request, "BAD_WORDS_DICT")),
            pb_utils.Tensor("STOP_WORDS_IDS", self._words(request, "STOP_WORDS_DICT")),
            pb_utils.Tensor("EMBEDDING_BIAS", self._bias(request)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", out_len.reshape(1, -1).astype(np.int32)),
            pb_utils.Tensor("OUT_END_ID", np.array([[end_id]], dtype=np.int32)),
            pb_utils.Tensor("OUT_PAD_ID", np.array([[pad_id]], dtype=np.int32)),
        ]

    @staticmethod
    def _scalar(request, name, default):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return int(t.as_numpy().reshape(-1)[0]) if t is not None else default

    def _strings(self, request, name):
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return []
        words = []
        for item in t.as_numpy().reshape(-1):
            text = item.decode("utf-8") if isinstance(item, bytes) else str(item)
            if text:
                words += [w for row in csv.reader([text]) for w in row if w]
        return words

    def _words(self, request, name):
        ids, offsets = [], []
        for word in self._strings(request, name):
            tokens = self.tokenizer.encode(word, add_special_tokens=False)
            if tokens:
                ids += tokens
                offsets.append(len(ids))
        if not ids:
            return np.zeros((1, 2, 0), dtype=np.int32)
        offsets += [-1] * (len(ids) - len(offsets))
        return np.array([[ids, offsets]], dtype=np.int32)

    def _bias(self, request):
        words = self._strings(request, "EMBEDDING_BIAS_WORDS")
        w = pb_utils.get_input_tensor_by_name(request, "EMBEDDING_BIAS_WEIGHTS")
        weights = w.as_numpy().reshape(-1) if w is not None else np.zeros(0, np.float32)
        if not words:
            return np.zeros((1, 0), dtype=np.float32)
        if len(words) != len(weights):
            raise ValueError(f"{len(words)} embedding_bias_words but {len(weights)} weights")
        bias = np.zeros(self.vocab_size, dtype=np.float32)
        for word, weight in zip(words, weights, strict=True):
            for token in self.tokenizer.encode(word, add_special_tokens=False)[:1]:
                bias[token] += weight
        return bias.reshape(1, -1)
