"""moepipe postprocessing: token ids -> text, with TensorRT-LLM's tensor contract.

``TOKENS_BATCH`` [B, beams, n] with ``SEQUENCE_LENGTH`` [B, beams] gives ``OUTPUT``: one
string per (row, beam), flattened to ONE dimension, as TensorRT-LLM's postprocessing returns
it (triton_backend/all_models/inflight_batcher_llm/postprocessing/1/model.py): a response of
the ensemble carries ``text_output`` of shape [beams], so ``text_output[0]`` is the text.
Needs only numpy and transformers.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"],
                                                       trust_remote_code=False)
        self.skip_special = params.get("skip_special_tokens", "true").lower() == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            if tokens.ndim == 2:  # [batch, n]: one beam
                tokens = tokens[:, None]
            lengths = lengths.reshape(tokens.shape[0], tokens.shape[1])
            texts = [self.tokenizer.decode(beam[: int(n)].tolist(),
                                           skip_special_tokens=self.skip_special).encode("utf-8")
                     for batch, lens in zip(tokens, lengths, strict=True)
                     for beam, n in zip(batch, lens, strict=True)]
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT", np.array(texts, dtype=object))]))
        return responses
