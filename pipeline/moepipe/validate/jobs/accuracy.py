"""``accuracy``: greedy tokens of the deployment (its ``tensorrt_llm`` model, fed the token ids
the deployment's tokenizer makes) against Hugging Face ``generate`` on the source checkpoint;
a quantized cpu deployment also against the reference runtime on the deployed checkpoint."""

from __future__ import annotations

import functools

import numpy as np

from moepipe.targets import get_target
from moepipe.validate import client
from moepipe.validate.base import JobContext
from moepipe.validate.report import JobResult, check


def accuracy(ctx: JobContext) -> JobResult:
    ep, cfg, model_dir = ctx.endpoint, ctx.cfg, ctx.model_dir
    job = JobResult("accuracy")
    v = cfg.validation
    state: dict = {}

    def reference():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging

        logging.disable_progress_bar()
        if model_dir is None:
            raise FileNotFoundError("the source checkpoint is not available")
        trust = cfg.model.trust_remote_code
        state["tok"] = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust)
        state["hf"] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, trust_remote_code=trust).eval()
        return {"model": str(model_dir)}

    case = job.run("load_reference", reference)
    if case.status != "passed":
        return job
    tok, hf = state["tok"], state["hf"]
    eos = tok.eos_token_id
    for i, prompt in enumerate(v.prompts):
        job.run(f"greedy_tokens_{i}", functools.partial(_compare, ep, cfg, tok, hf, eos, prompt))
    if v.min_token_agreement >= 1.0:
        job.run("ensemble_text", lambda: _text(ep, cfg, tok, hf, eos, v.prompts[0]))
    # Where moepipe's runtime serves the converted checkpoint, the served tokens are checked
    # against that runtime on the same (quantized) checkpoint.
    if get_target(cfg.target).artifact == "checkpoint" and cfg.quantize.format != "none":
        job.run("deployed_checkpoint", lambda: _deployed(ctx, tok, eos, v.prompts))
    return job


def _deployed(ctx: JobContext, tok, eos, prompts) -> dict:
    """A quantized model is not expected to equal transformers token for token; what is
    served must still equal what was measured: greedy tokens of the reference runtime on the
    deployed (quantized, converted) checkpoint, exactly."""
    from moepipe.runtime.checkpoint import load_checkpoint
    from moepipe.runtime.generate import generate
    from moepipe.runtime.model import ReferenceModel

    ep, cfg, ckpt = ctx.endpoint, ctx.cfg, ctx.checkpoint_dir
    if ckpt is None:
        raise FileNotFoundError("the converted checkpoint is not available")
    model = ReferenceModel(load_checkpoint(ckpt))
    for prompt in prompts:
        ids = tok(prompt, add_special_tokens=cfg.deploy.add_special_tokens).input_ids
        want = generate(model, [ids], cfg.validation.max_tokens, end_id=eos)[0]
        got = _server_tokens(ep, cfg, ids, eos)
        check(got == want, f"server {got} != reference runtime on {ckpt} {want}")
    return {"checkpoint": str(ckpt), "prompts": len(prompts)}


def _hf_generate(cfg, tok, hf, eos, prompt) -> tuple[list[int], list[int]]:
    import torch

    ids = tok(prompt, add_special_tokens=cfg.deploy.add_special_tokens).input_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=cfg.validation.max_tokens,
                          do_sample=False, eos_token_id=eos,
                          pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
    new = out[0, len(ids):].tolist()
    if eos is not None and eos in new:  # TensorRT-LLM's outputs stop before end_id
        new = new[:new.index(eos)]
    return ids, new


def _compare(ep, cfg, tok, hf, eos, prompt) -> dict:
    ids, want = _hf_generate(cfg, tok, hf, eos, prompt)
    got = _server_tokens(ep, cfg, ids, eos)
    same = sum(a == b for a, b in zip(want, got, strict=False))
    agreement = same / max(len(want), len(got), 1)
    details = {"prompt": prompt, "hf_tokens": want, "server_tokens": got,
               "agreement": round(agreement, 4)}
    check(agreement >= cfg.validation.min_token_agreement,
          f"token agreement {agreement:.3f} < {cfg.validation.min_token_agreement} "
          f"(hf {want} vs server {got})")
    return details


def _server_tokens(ep, cfg, ids, eos) -> list[int]:
    inputs = {"input_ids": np.array([ids], np.int32),
              "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[cfg.validation.max_tokens]], np.int32),
              "exclude_input_in_output": np.array([[True]], np.bool_)}
    if eos is not None:
        inputs["end_id"] = np.array([[eos]], np.int32)
    res = client.grpc_infer(ep.grpc, "tensorrt_llm", inputs, ["output_ids", "sequence_length"],
                            ep.timeout, ep.parameters)
    out = res.outputs[-1]
    return out["output_ids"].reshape(-1)[: int(out["sequence_length"].reshape(-1)[0])].tolist()


def _text(ep, cfg, tok, hf, eos, prompt) -> dict:
    _, want = _hf_generate(cfg, tok, hf, eos, prompt)
    expected = tok.decode(want, skip_special_tokens=cfg.deploy.skip_special_tokens)
    got = client.generate(ep.http, "ensemble",
                          {"text_input": prompt, "max_tokens": cfg.validation.max_tokens,
                           "exclude_input_in_output": True},  # the generated text only
                          ep.timeout, ep.parameters)["text_output"]
    check(got == expected, f"ensemble text {got!r} != transformers {expected!r}")
    return {"text": got}
