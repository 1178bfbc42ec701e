"""Deploy: Triton model repositories for every target, and the local Triton server."""
