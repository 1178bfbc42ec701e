"""Validation jobs: each is a function (endpoint, config) -> JobResult of named checks.

The jobs under load (``perf``, ``burst``, ``long-tail``, ``balance``, ``recovery``) live in
their own modules; this one holds the correctness jobs and the registry.

* ``smoke``: health, readiness of every model, metadata/config, one request per protocol
  (HTTP generate, gRPC, gRPC streaming, HTTP generate_stream) through the ensemble.
* ``accuracy``: greedy tokens of the deployment (its ``tensorrt_llm`` model, fed the token ids
  the deployment's tokenizer makes) against Hugging Face ``generate`` on the source checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moepipe.config import MoepipeConfig
from moepipe.deploy import client
from moepipe.validate import balance, loadjobs, recovery
from moepipe.validate.report import JobResult, Skip, check

MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")


@dataclass
class Endpoint:
    http: str  # host:port
    grpc: str
    timeout: float = 120.0
    metrics: str | None = None  # host:port of the Prometheus metrics endpoint

    def get(self, path: str) -> dict:
        return client.http_json(self.http, path, timeout=self.timeout)

    def decoupled(self) -> bool:
        cfg = self.get("/v2/models/tensorrt_llm/config")
        return bool(cfg.get("model_transaction_policy", {}).get("decoupled", False))


@dataclass
class JobContext:
    """What a job gets: the endpoint, the config, and what the build produced."""

    endpoint: Endpoint
    cfg: MoepipeConfig
    model_dir: Path | None = None  # the source Hugging Face checkpoint
    checkpoint_dir: Path | None = None  # the converted TensorRT-LLM checkpoint (if any)
    state_dir: Path | None = None  # the local server's state (pid file), for `recovery`


def smoke(ctx: JobContext) -> JobResult:
    ep, cfg = ctx.endpoint, ctx.cfg
    job = JobResult("smoke")
    prompt = cfg.validation.prompts[0]

    def live():
        ep.get("/v2/health/live")
        return {}

    def ready():
        ep.get("/v2/health/ready")
        return {}

    def models_ready():
        for m in MODELS:
            ep.get(f"/v2/models/{m}/ready")
        return {"models": list(MODELS)}

    def metadata():
        meta = ep.get("/v2/models/ensemble")
        inputs = {t["name"]: t["datatype"] for t in meta["inputs"]}
        outputs = {t["name"]: t["datatype"] for t in meta["outputs"]}
        check(inputs.get("text_input") == "BYTES", f"text_input: {inputs.get('text_input')}")
        check(inputs.get("max_tokens") == "INT32", f"max_tokens: {inputs.get('max_tokens')}")
        check(outputs.get("text_output") == "BYTES", "no text_output output")
        config = ep.get("/v2/models/tensorrt_llm/config")
        return {"ensemble_inputs": sorted(inputs), "max_batch_size": config["max_batch_size"],
                "decoupled": ep.decoupled()}

    def http_generate():
        out = client.generate(ep.http, "ensemble", {"text_input": prompt, "max_tokens": 4},
                              ep.timeout)
        check(isinstance(out.get("text_output"), str) and out["text_output"], str(out))
        return {"text_output": out["text_output"]}

    def grpc_request():
        res = client.grpc_infer(ep.grpc, "ensemble", client.text_inputs(prompt, 4),
                                ["text_output"], ep.timeout)
        check(len(res.outputs) == 1, f"{len(res.outputs)} responses for stream=false")
        text = res.outputs[0]["text_output"].reshape(-1)[0].decode()
        check(text, "empty text_output")
        return {"text_output": text}

    def grpc_streaming():
        if not ep.decoupled():
            raise Skip("the deployment is not decoupled (deploy.decoupled: false)")
        res = client.grpc_infer(ep.grpc, "ensemble", client.text_inputs(prompt, 4, stream=True),
                                ["text_output"], ep.timeout)
        check(len(res.outputs) >= 2, f"expected one response per token, got {len(res.outputs)}")
        return {"responses": len(res.outputs)}

    def http_generate_stream():
        if not ep.decoupled():
            raise Skip("the deployment is not decoupled (deploy.decoupled: false)")
        events = client.generate_stream(ep.http, "ensemble",
                                        {"text_input": prompt, "max_tokens": 4, "stream": True},
                                        ep.timeout)
        check(len(events) >= 2, f"expected one event per token, got {len(events)}")
        return {"events": len(events)}

    checks: list[tuple[str, Callable]] = [
        ("server_live", live), ("server_ready", ready), ("models_ready", models_ready),
        ("metadata_and_config", metadata), ("http_generate", http_generate),
        ("grpc_request", grpc_request), ("grpc_streaming", grpc_streaming),
        ("http_generate_stream", http_generate_stream)]
    for name, fn in checks:
        job.run(name, fn)
    return job


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
    if cfg.target == "cpu" and cfg.quantize.format != "none":
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
                            ep.timeout)
    out = res.outputs[-1]
    return out["output_ids"].reshape(-1)[: int(out["sequence_length"].reshape(-1)[0])].tolist()


def _text(ep, cfg, tok, hf, eos, prompt) -> dict:
    _, want = _hf_generate(cfg, tok, hf, eos, prompt)
    expected = tok.decode(want, skip_special_tokens=cfg.deploy.skip_special_tokens)
    got = client.generate(ep.http, "ensemble",
                          {"text_input": prompt, "max_tokens": cfg.validation.max_tokens,
                           "exclude_input_in_output": True},  # the generated text only
                          ep.timeout)["text_output"]
    check(got == expected, f"ensemble text {got!r} != transformers {expected!r}")
    return {"text": got}


JOBS: dict[str, Callable[[JobContext], JobResult]] = {
    "smoke": smoke, "accuracy": accuracy, "perf": loadjobs.perf, "burst": loadjobs.burst,
    "long-tail": loadjobs.long_tail, "balance": balance.balance,
    "recovery": recovery.recovery}
