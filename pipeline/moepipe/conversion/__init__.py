"""Hugging Face checkpoint -> TensorRT-LLM checkpoint, below the build stage that runs it
(:mod:`moepipe.stages.convert`): :mod:`.plan` plans and validates every rank's tensors before a
byte is written, :mod:`.write` streams them into the rank files."""
