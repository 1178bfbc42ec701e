"""Triton model-repository templates (data, installed with moepipe).

``common/`` holds the models every target shares (ensemble, preprocessing, postprocessing,
tensorrt_llm_bls); ``targets/<target>/`` holds the target's ``tensorrt_llm`` model and extras.
Files ending in ``.pbtxt``, ``.yaml`` and ``.sh`` are templates with ``${name}`` placeholders,
rendered strictly by :mod:`moepipe.deploy.render.templates`.
"""
