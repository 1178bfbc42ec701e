"""The families that only moepipe's reference runtime serves in this suite (TensorRT-LLM's GPU
targets cannot be run here, and the engine path has no model for them): each is built,
deployed on the cpu target (tp=1, a real tritonserver on loopback) and validated with the
smoke and accuracy jobs (greedy tokens over HTTP equal transformers' token for token).

Families come from the registries: every registered family that a GPU target refuses
(``Family.no_engine`` / ``no_pytorch``) is deployed here, except those an e2e module of their own
deploys (DeepSeek: test_deepseek_deploy.py). The servers are started and stopped concurrently
(a server start is mostly waiting: about half the time of one after the other)."""

from concurrent.futures import ThreadPoolExecutor, wait

from helpers import make_config

from moepipe.arch import REGISTRY
from moepipe.examples import family_examples

OWN_MODULE = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}
CPU_ONLY_SOMEWHERE = sorted(family_examples()[arch] for arch, f in REGISTRY.items()
                            if (f.no_engine or f.no_pytorch) and arch not in OWN_MODULE)


def test_families_deploy_on_cpu_and_validate(tmp_path):
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import endpoint_for, run_validate
    from moepipe.deploy.local import lifecycle
    from moepipe.deploy.local.state import read_state

    assert CPU_ONLY_SOMEWHERE  # OLMoE and GPT-OSS at least
    cfgs = {ex: make_config(tmp_path / ex, example=ex, parallel={"tp": 1, "moe_ep": 1},
                            build={"max_batch_size": 4, "max_input_len": 128,
                                   "max_seq_len": 256},
                            validate={"max_tokens": 8})
            for ex in CPU_ONLY_SOMEWHERE}

    for ex in cfgs:  # in this thread: transformers' lazy imports are not thread-safe
        run_build(tmp_path / ex / "moepipe.yaml", echo=lambda s: None)

    def deploy(ex):
        run_deploy(cfgs[ex], echo=lambda s: None)

    def stop(ex):
        if read_state(state_dir(cfgs[ex])) is not None:
            lifecycle.stop(state_dir(cfgs[ex]), grace=20)

    reports = {}
    with ThreadPoolExecutor(len(cfgs)) as pool:
        futures = [pool.submit(deploy, ex) for ex in cfgs]
        try:
            wait(futures)  # every start has finished (or failed) before anything is stopped
            for future in futures:
                future.result()
            for ex, cfg in cfgs.items():
                ep = endpoint_for(cfg, None, None)
                reports[ex], _ = run_validate(cfg, ep.http, ep.grpc, jobs=["smoke", "accuracy"],
                                              echo=lambda s: None)
        finally:
            list(pool.map(stop, cfgs))
    for ex, report in reports.items():
        assert report.passed, (ex, report.to_dict())
        accuracy = next(j for j in report.jobs if j.job == "accuracy")
        assert accuracy.cases and all(c.status == "passed" for c in accuracy.cases), ex
