"""Container files of moepipe (``docker/`` in the source tree).

Only ``versions.env`` ships in the wheel, as package data: the TensorRT-LLM version and NGC image
that :mod:`moepipe.trtllm.versions` reads. ``Dockerfile`` builds moepipe into that image.
"""
