"""moepipe postprocessing: token ids -> text, with TensorRT-LLM's tensor contract.

``TOKENS_BATCH`` [B, beams, n] with ``SEQUENCE_LENGTH`` [B, beams] gives ``OUTPUT``: one
string per (row, beam), flattened to ONE dimension, as TensorRT-LLM's postprocessing returns
it (triton_backend/all_models/inflight_batcher_llm/postprocessing/1/model.py): a response of
the ensemble carries ``text_output`` of shape [beams], so ``text_output[0]`` is the text.
The ids it decodes are checked as the ``tensorrt_llm`` model checks a prompt's (0 to the
model's vocab_size - 1, in the serving core's words): a request with any other is refused
(INVALID_ARG) instead of failing in the tokenizer. Needs only numpy and transformers.
"""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_core.checks import check_token_ids  # noqa: E402 - shipped beside this file
from serving_core.errors import RequestError  # noqa: E402
from serving_core.triton import error_response, flag, model_path, parameters  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = parameters(json.loads(args["model_config"]))
        # relative to this model's folder (moepipe.deploy.serve_paths): the folder may move
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path(args, params["tokenizer_dir"]), trust_remote_code=False)
        self.skip_special = flag(params.get("skip_special_tokens"), default=True)
        self.vocab_size = int(params.get("vocab_size") or len(self.tokenizer))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                texts = self._decode(request)
            except ValueError as e:  # the request's own fault: answered, the others decoded
                responses.append(error_response(pb_utils, e))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT", np.array(texts, dtype=object))]))
        return responses

    def _decode(self, request):
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
        if tokens.ndim == 2:  # [batch, n]: one beam
            tokens = tokens[:, None]
        if tokens.ndim != 3 or lengths.size != tokens.shape[0] * tokens.shape[1]:
            raise RequestError(f"SEQUENCE_LENGTH {list(lengths.shape)} does not give one length "
                               f"per beam of TOKENS_BATCH {list(tokens.shape)}")
        lengths = lengths.reshape(tokens.shape[0], tokens.shape[1])
        texts = []
        for batch, lens in zip(tokens, lengths, strict=True):
            for beam, n in zip(batch, lens, strict=True):
                if not 0 <= n <= beam.size:
                    raise RequestError(f"SEQUENCE_LENGTH {n} is outside 0..{beam.size} (the "
                                       "length of TOKENS_BATCH)")
                ids = beam[: int(n)].tolist()
                check_token_ids(ids, self.vocab_size)
                texts.append(self.tokenizer.decode(
                    ids, skip_special_tokens=self.skip_special).encode("utf-8"))
        return texts
