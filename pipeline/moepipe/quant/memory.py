"""Peak host memory of layer-by-layer quantization: the one formula behind the build's
pre-flight check (``stages.quantize``) and ``moepipe plan``'s ``host_memory.quantize``.

One segment of the model is resident at a time - a decoder layer, or the embedding, or
``lm_head`` - plus the calibration activations, so the number of layers does not appear:

    peak = BASE + BYTES_PER_PARAM x max(decoder layer, embedding, lm_head parameters)
                + ACTIVATION_COPIES x calibration tokens x hidden size x 4 bytes

The constants are measured by ``benchmarks/quantize_layerwise_bench.py`` (README, "Layer-by-layer
quantization"): a segment is held in float32 for calibration (4 bytes per parameter) and, while
it is exported, cast to the checkpoint's 16-bit dtype and quantized in float32 one tensor at a
time; the activations are a layer's inputs and outputs in float32.
"""

from __future__ import annotations

BASE = 1 << 30  # torch, transformers and modelopt imported, the meta model, the reader
BYTES_PER_PARAM = 8  # float32 calibration copy + export copies (measured: see the docstring)
ACTIVATION_COPIES = 2  # a layer's inputs and its outputs, float32


def quantize_memory(layer_params: int, outer_params: int, hidden_size: int,
                    calibration_tokens: int) -> int:
    """Peak host bytes of quantizing a model whose largest decoder layer has ``layer_params``
    parameters and whose embedding (or lm_head) has ``outer_params``, calibrated on
    ``calibration_tokens`` tokens."""
    return (BASE + BYTES_PER_PARAM * max(layer_params, outer_params)
            + activation_bytes(hidden_size, calibration_tokens))


def activation_bytes(hidden_size: int, calibration_tokens: int) -> int:
    """The calibration activations held between two layers (float32 inputs and outputs)."""
    return ACTIVATION_COPIES * calibration_tokens * hidden_size * 4
