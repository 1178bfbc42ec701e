"""Fixtures of the unit tier."""

import pytest


@pytest.fixture(scope="session")
def live_builds(examples, tmp_path_factory):
    """Converted checkpoints of tiny-mixtral (``old``) and of it with expert 1 of layer 0
    re-trained (``new``), at world size 1 and (``-ep``) at tp=2, moe_ep=2: what a live update
    goes from and to."""
    from retrained import retrain_experts

    from moepipe.conversion.write import convert

    root = tmp_path_factory.mktemp("live")
    src = examples["tiny-mixtral"]
    sources = {"old": src, "new": retrain_experts(src, root / "retrained", layer=0,
                                                   experts=(1,))}
    out = {}
    for name, source in sources.items():
        out[name] = convert(source, root / name).output
        out[f"{name}-ep"] = convert(source, root / f"{name}-ep", tp=2, moe_ep=2).output
    return out
