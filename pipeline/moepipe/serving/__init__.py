"""Serving: the in-flight batching engine the CPU target's Triton model runs."""
