"""The one sizing model: every byte a model takes, from arch's ModelSpec and TensorRT-LLM's
sharding rules. ``shapes`` (each tensor of a layer and how ranks share it), ``weights`` (the bytes
one GPU holds, per quantization format), ``gpu`` (KV cache per token, the step reserve) and
``pods`` (host memory of a serving pod); the planner, the engine's pre-flight, the quantize
stage and the Kubernetes manifests all count with it."""
