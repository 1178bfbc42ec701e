"""Quantization: modelopt calibration/export (stage ``quantize``), the TensorRT-LLM quantized
checkpoint layout (:mod:`moepipe.quant.trtllm`), and dequantization for the reference runtime
(:mod:`moepipe.quant.dequant`)."""
