"""The request/response rules of a ``tensorrt_llm``-contract Triton model, for every target.

Parse and validate a request's tensors (``contract``, ``checks``), admit it or refuse it as busy
(``admission``), group the FINAL flag over its rows and turn results into response tensors
(``responses``), send on one thread and poll cancellation (``outbox``), and run one
``execute`` over an engine (``frontend``); ``triton`` is what every Python model of the
repository shares (parameters, error codes). One set of texts for every target (``errors``).

Imports nothing but the standard library, numpy and itself (relative imports only): the
renderer ships this folder into each Python model's version folder as ``serving_core``
(``moepipe.deploy.render.repository``), because moepipe is not installed in NVIDIA's Triton
containers. ``tests/unit/test_serving_core.py`` holds the import rule.
"""
