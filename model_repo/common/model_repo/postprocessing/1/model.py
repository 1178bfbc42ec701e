"""moepipe postprocessing: token ids -> text, with TensorRT-LLM's tensor contract.

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
            tokens = tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])  # [batch, beam, n]
            lengths = lengths.reshape(tokens.shape[0], -1)
            texts = [[self.tokenizer.decode(beam[: int(n)].tolist(),
                                            skip_special_tokens=self.skip_special)
                      .encode("utf-8") for beam, n in zip(batch, lens, strict=True)]
                     for batch, lens in zip(tokens, lengths, strict=True)]
            out = np.array(texts, dtype=object).reshape(tokens.shape[0], -1)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
        return responses
