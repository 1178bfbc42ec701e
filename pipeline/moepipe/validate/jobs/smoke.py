"""``smoke``: health, readiness of every model, metadata/config, one request per protocol
(HTTP generate, gRPC, gRPC streaming, HTTP generate_stream) through the ensemble."""

from __future__ import annotations

from collections.abc import Callable

from moepipe.validate import client
from moepipe.validate.base import MODELS, JobContext
from moepipe.validate.report import JobResult, Skip, check


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
                              ep.timeout, ep.parameters)
        check(isinstance(out.get("text_output"), str) and out["text_output"], str(out))
        return {"text_output": out["text_output"]}

    def grpc_request():
        res = client.grpc_infer(ep.grpc, "ensemble", client.text_inputs(prompt, 4),
                                ["text_output"], ep.timeout, ep.parameters)
        check(len(res.outputs) == 1, f"{len(res.outputs)} responses for stream=false")
        text = res.outputs[0]["text_output"].reshape(-1)[0].decode()
        check(text, "empty text_output")
        return {"text_output": text}

    def grpc_streaming():
        if not ep.decoupled():
            raise Skip("the deployment is not decoupled (deploy.decoupled: false)")
        res = client.grpc_infer(ep.grpc, "ensemble", client.text_inputs(prompt, 4, stream=True),
                                ["text_output"], ep.timeout, ep.parameters)
        check(len(res.outputs) >= 2, f"expected one response per token, got {len(res.outputs)}")
        return {"responses": len(res.outputs)}

    def http_generate_stream():
        if not ep.decoupled():
            raise Skip("the deployment is not decoupled (deploy.decoupled: false)")
        events = client.generate_stream(ep.http, "ensemble",
                                        {"text_input": prompt, "max_tokens": 4, "stream": True},
                                        ep.timeout, ep.parameters)
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
