"""moepipe preprocessing: text -> token ids, with TensorRT-LLM's tensor contract.

Needs only numpy and transformers (runs in NVIDIA's Triton containers as well as locally).
A request of batch size B gives B rows: ``INPUT_ID`` [B, longest] padded with the pad id,
``REQUEST_INPUT_LEN`` [B, 1], and per row the end / pad ids, the word lists and the embedding
bias, as TensorRT-LLM's preprocessing (triton_backend/all_models/inflight_batcher_llm/
preprocessing/1/model.py) makes them. Each element of ``stop_words`` / ``bad_words`` is one
word (any string); word lists are ``[B, 2, n]`` INT32: row 0 the concatenated ids, row 1 the
cumulative end offsets padded with -1.
"""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_core.triton import error_response, flag, model_path, parameters  # noqa: E402 - shipped beside

# Inputs of TensorRT-LLM's preprocessing for features moepipe's models do not have.
UNSUPPORTED = {"DECODER_QUERY": "decoder_text_input is for encoder-decoder models",
               "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id is for prompt tuning"}


def _text(item) -> str:
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = parameters(cfg)
        # relative to this model's folder (moepipe.deploy.serve_paths): the folder may move
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path(args, params["tokenizer_dir"]), trust_remote_code=False)
        self.add_special_tokens = flag(params.get("add_special_tokens"))
        self.vocab_size = int(params.get("vocab_size") or len(self.tokenizer))
        # A prompt longer than max_input_len tokens of the longest token (twice, for
        # normalizers that drop characters) is refused before tokenizing: a 40 MB prompt would
        # otherwise hold this model for minutes before the engine refuses it.
        max_input_len = int(params.get("max_input_len") or 0)
        longest = max((len(t) for t in self.tokenizer.convert_ids_to_tokens(
            list(range(len(self.tokenizer)))) if t), default=1)
        self.max_chars = 2 * max_input_len * longest + 1024 if max_input_len else 0
        self.max_input_len = max_input_len
        self.end_id = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.end_id

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._one(request)))
            except ValueError as e:
                responses.append(error_response(pb_utils, e))
        return responses

    def _one(self, request):
        for name, why in UNSUPPORTED.items():
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None and t.as_numpy().size:
                raise ValueError(f"{why}, which moepipe does not serve")
        query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
        batch = query.shape[0]
        rows = []
        for item in query.reshape(batch, -1)[:, 0]:
            text = _text(item)
            if not text:
                raise ValueError("the prompt (text_input) is empty")
            if self.max_chars and len(text) > self.max_chars:
                raise ValueError(f"the prompt (text_input) has {len(text)} characters: more "
                                 f"than max_input_len={self.max_input_len} tokens can hold "
                                 f"(refused before tokenizing)")
            ids = self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens)
            if not ids:
                raise ValueError("the prompt (text_input) encodes to no tokens")
            rows.append(ids)
        out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy()
        end_id = self._per_row(request, "END_ID", self.end_id, batch)
        pad_id = self._per_row(request, "PAD_ID", self.pad_id, batch)
        longest = max(len(r) for r in rows)
        input_ids = np.array([r + [int(pad_id[b, 0])] * (longest - len(r))
                              for b, r in enumerate(rows)], dtype=np.int32)
        return [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(r)] for r in rows], np.int32)),
            pb_utils.Tensor("BAD_WORDS_IDS", self._words(request, "BAD_WORDS_DICT", batch)),
            pb_utils.Tensor("STOP_WORDS_IDS", self._words(request, "STOP_WORDS_DICT", batch)),
            pb_utils.Tensor("EMBEDDING_BIAS", self._bias(request, batch)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", out_len.reshape(batch, 1).astype(np.int32)),
            pb_utils.Tensor("OUT_END_ID", end_id),
            pb_utils.Tensor("OUT_PAD_ID", pad_id),
        ]

    @staticmethod
    def _per_row(request, name, default, batch):
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return np.full((batch, 1), default, dtype=np.int32)
        return t.as_numpy().reshape(batch, 1).astype(np.int32)

    @staticmethod
    def _strings(request, name, batch):
        """Per row, the non-empty strings of a ``[B, n]`` STRING input (None when absent)."""
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return None
        return [[_text(x) for x in row if _text(x)] for row in t.as_numpy().reshape(batch, -1)]

    def _words(self, request, name, batch):
        words = self._strings(request, name, batch)
        if words is None:
            return np.zeros((batch, 2, 0), dtype=np.int32)
        ids, offsets = [], []
        for row in words:
            row_ids, row_offsets = [], []
            for word in row:
                tokens = self.tokenizer.encode(word, add_special_tokens=False)
                if tokens:
                    row_ids += tokens
                    row_offsets.append(len(row_ids))
            ids.append(row_ids)
            offsets.append(row_offsets)
        width = max(1, max(len(r) for r in ids))
        return np.array([[r + [0] * (width - len(r)), o + [-1] * (width - len(o))]
                         for r, o in zip(ids, offsets, strict=True)], dtype=np.int32)

    def _bias(self, request, batch):
        words = self._strings(request, "EMBEDDING_BIAS_WORDS", batch)
        w = pb_utils.get_input_tensor_by_name(request, "EMBEDDING_BIAS_WEIGHTS")
        if words is None or w is None:
            return np.zeros((batch, 0), dtype=np.float32)
        weights = w.as_numpy().reshape(batch, -1)
        bias = np.zeros((batch, self.vocab_size), dtype=np.float32)
        for b, (row, row_weights) in enumerate(zip(words, weights, strict=True)):
            if len(row) != len(row_weights):
                raise ValueError(f"{len(row)} embedding_bias_words but {len(row_weights)} "
                                 "weights")
            for word, weight in zip(row, row_weights, strict=True):
                for token in self.tokenizer.encode(word, add_special_tokens=False):
                    bias[b, token] += weight
        return bias
