"""Peak host memory of layer-by-layer quantization: the one formula behind the build's
pre-flight check (``stages.quantize``) and ``moepipe plan``'s ``host_memory.quantize``.

One segment of the model is resident at a time - a decoder layer, or the embedding, or
``lm_head`` - plus the calibration activations, so the number of layers does not appear:

    peak = BASE + BYTES_PER_PARAM x max(decoder layer, embedding, lm_head parameters)
                + ACTIVATION_COPIES x calibration tokens x hidden size x 4 bytes

The constants come from ``benchmarks/quantize_layerwise_bench.py`` (README, "Layer-by-layer
quantization"): a segment is held in float32 for calibration (4 bytes per parameter) and the
export casts and quantizes it one tensor at a time, so the peak is the float32 layer and a few
of its largest tensors' copies - measured 5.77 GiB over the imports for Mixtral-8x7B's own
1.45 G-parameter layer (4.27 bytes per parameter), 0.60-0.76 GiB for a 91 M-parameter one;
the imports (torch, transformers, modelopt) take 0.55 GiB, modelopt's lazy ones and the
allocator some more. The activations are a layer's inputs and outputs in float32.
"""

from __future__ import annotations

BASE = 1 << 30  # torch, transformers and modelopt imported, the meta model, the reader
BYTES_PER_PARAM = 4.5  # the float32 segment + its largest tensors' transient copies
ACTIVATION_COPIES = 2  # a layer's inputs and its outputs, float32


def quantize_memory(layer_params: int, outer_params: int, hidden_size: int,
                    calibration_tokens: int) -> int:
    """Peak host bytes of quantizing a model whose largest decoder layer has ``layer_params``
    parameters and whose embedding (or lm_head) has ``outer_params``, calibrated on
    ``calibration_tokens`` tokens."""
    return (BASE + segment_bytes(layer_params, outer_params)
            + activation_bytes(hidden_size, calibration_tokens))


def segment_bytes(layer_params: int, outer_params: int) -> int:
    """The largest segment while it is calibrated and exported."""
    return int(BYTES_PER_PARAM * max(layer_params, outer_params))


def activation_bytes(hidden_size: int, calibration_tokens: int) -> int:
    """The calibration activations held between two layers (float32 inputs and outputs)."""
    return ACTIVATION_COPIES * calibration_tokens * hidden_size * 4
