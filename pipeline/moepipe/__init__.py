"""moepipe: Mixture-of-Experts checkpoints to validated Triton + TensorRT-LLM deployments."""

__version__ = "0.1.0"
