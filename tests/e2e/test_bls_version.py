"""A request pinned to a weights version (Triton request parameter ``moepipe_version``, what a
live update validates a staged version with) stays pinned through ``tensorrt_llm_bls`` as it
does through the ensemble: the BLS passes the parameter on to ``tensorrt_llm``
(python_backend ``src/pb_stub.cc``: BLS ``InferenceRequest`` takes ``parameters``)."""

import pytest

from moepipe.commands.validate import serving_version
from moepipe.validate.client import generate_stream

PAYLOAD = {"text_input": "It is a truth universally acknowledged", "max_tokens": 4}


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_pinned_version_reaches_the_model_through(deployment, model):
    _, ep = deployment
    version = serving_version(ep)
    assert version
    served = generate_stream(ep.http, model, PAYLOAD, parameters={"moepipe_version": version})
    assert "".join(e.get("text_output", "") for e in served)
    with pytest.raises(Exception, match="weights version 'feedfacefeed' is not loaded here"):
        generate_stream(ep.http, model, PAYLOAD, parameters={"moepipe_version": "feedfacefeed"})
    # without the parameter: the serving version, as before
    assert generate_stream(ep.http, model, PAYLOAD) == served
