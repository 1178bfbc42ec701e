"""The families that only moepipe's reference runtime serves in this suite (TensorRT-LLM's GPU
targets cannot be run here, and the engine path has no model for them): each is built,
deployed on the cpu target (tp=1, a real tritonserver on loopback) and validated with the
smoke and accuracy jobs (greedy tokens over HTTP equal transformers' token for token).

Families come from the registries: every registered family that a GPU target refuses
(``Family.no_engine`` / ``no_pytorch``) is deployed here, except those an e2e module of their own
deploys (DeepSeek: test_deepseek_deploy.py)."""

import pytest
from helpers import make_config

from moepipe.arch import REGISTRY
from moepipe.examples import family_examples

OWN_MODULE = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}
CPU_ONLY_SOMEWHERE = sorted(family_examples()[arch] for arch, f in REGISTRY.items()
                            if (f.no_engine or f.no_pytorch) and arch not in OWN_MODULE)


@pytest.mark.parametrize("example", CPU_ONLY_SOMEWHERE)
def test_family_deploys_on_cpu_and_validates(example, tmp_path):
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import endpoint_for, run_validate
    from moepipe.deploy import server

    cfg = make_config(tmp_path / "work", example=example, parallel={"tp": 1, "moe_ep": 1},
                      build={"max_batch_size": 4, "max_input_len": 128, "max_seq_len": 256},
                      validate={"max_tokens": 8})
    run_build(tmp_path / "work" / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    try:
        ep = endpoint_for(cfg, None, None)
        report, _ = run_validate(cfg, ep.http, ep.grpc, jobs=["smoke", "accuracy"],
                                 echo=lambda s: None)
    finally:
        server.stop(state_dir(cfg), grace=20)
    assert report.passed, report.to_dict()
    accuracy = next(j for j in report.jobs if j.job == "accuracy")
    assert accuracy.cases and all(c.status == "passed" for c in accuracy.cases)
