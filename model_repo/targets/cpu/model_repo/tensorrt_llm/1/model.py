"""moepipe `cpu` target: the reference runtime as Triton's ``tensorrt_llm`` model.

A thin adapter. The serving core shipped beside this file (``serving_core``, the renderer's
copy of ``moepipe.serving.core``) serves TensorRT-LLM 1.2's tensor contract: rows and sequences
of a request, FINAL with the last response, ``stop`` by request id, refusals with upstream's
texts and codes, busy refusals. This file runs each generation on moepipe's in-flight batcher
(``moepipe.serving.batcher``) over the reference runtime; the engine thread only records, and
responses are built and sent on the core's outbox thread. Metrics: expert routing
(``moepipe_expert_tokens_total{model,layer,expert}``), generated and prompt tokens, latency /
TTFT / queue histograms and occupancy gauges (``moepipe.serving.metrics``), TensorRT-LLM's own
families (``moepipe.serving.trtllm_metrics``), the serving weights version
(``moepipe_model_info``). New weights of the same model are staged, validated and switched to
while serving, over the control socket (``moepipe.serving.live``); a request may name a staged
version (Triton request parameter ``moepipe_version``).

World size > 1: this model is rank 0 of a rank group (``moepipe.ranks.leader``), loading only
``rank0.safetensors``; ``initialize`` returns once the workers have joined. A lost rank ends
every request in flight with UNAVAILABLE, refuses new ones and withdraws readiness
(``is_ready``) until the next group is formed; per-rank step timings are exported by
``moepipe.serving.rank_metrics``.
"""

import json
import os
import sys
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_core import checks, contract, responses  # noqa: E402 - shipped beside this file
from serving_core.admission import Admission  # noqa: E402
from serving_core.frontend import Frontend  # noqa: E402
from serving_core.triton import flag, model_path, parameters  # noqa: E402

from moepipe.runtime.checkpoint import load_checkpoint  # noqa: E402
from moepipe.runtime.model import ReferenceModel  # noqa: E402
from moepipe.runtime.sampling import SamplingParams  # noqa: E402
from moepipe.serving.batcher import Batcher  # noqa: E402
from moepipe.serving.live import LiveUpdates, VersionMetric, start_control  # noqa: E402
from moepipe.serving.metrics import EngineCounters, ServingMetrics  # noqa: E402
from moepipe.serving.request import GenerationRequest  # noqa: E402
from moepipe.serving.trtllm_metrics import TrtllmMetrics, iteration_values  # noqa: E402
from moepipe.serving.versions import requested_version  # noqa: E402

# Metrics are calls into the server: publish them at most this often, not every step.
METRICS_PERIOD_S = 0.5
LOGITS_DTYPES = {"TYPE_FP32": np.float32, "TYPE_FP16": np.float16}


def build_engine(args: dict, params: dict, max_batch_size: int, on_step, leader=None
                 ) -> Batcher:
    """The engine this model serves, built in this one place: the in-flight batcher over the
    reference model of ``checkpoint_dir`` (relative to the model's folder,
    ``args["model_repository"]``), holding at most ``max_batch_size`` running and
    ``max_queue_size`` waiting requests (the core's admission, so its busy refusals are the
    core's). What the adapter uses of it: ``submit_all``, ``start``, ``stop``, ``model``
    (vocab_size, expert_tokens), ``max_input_len`` / ``max_seq_len`` and the metrics readers
    (``load``, ``active``, ``steps``, ``stats``, ``iteration_values``). With a rank group's
    ``leader`` the model is its rank 0 and the batcher asks it whether the group can step."""
    admission = Admission(max_batch_size, int(params.get("max_queue_size") or 0),
                          int(params.get("queue_timeout_microseconds") or 0) / 1e6)
    model = leader.model if leader is not None else \
        ReferenceModel(load_checkpoint(model_path(args, params["checkpoint_dir"])))
    return Batcher(model, max_batch_size=max_batch_size, max_seq_len=int(params["max_seq_len"]),
                   max_input_len=int(params["max_input_len"]), on_step=on_step,
                   admission=admission, health=leader,
                   version=params.get("weights_version") or "")


def form_group(args: dict, params: dict, max_batch_size: int):
    """World size > 1: rank 0 of the rank group, returned once every worker has joined (ready
    then means the group serves); None for one process."""
    world_size = int(params.get("world_size") or 1)
    if world_size <= 1:
        return None
    from moepipe.ranks.leader import GroupSettings, Leader

    leader = Leader(
        model_path(args, params["checkpoint_dir"]),
        GroupSettings(world_size, os.environ.get("MOEPIPE_RANK_LISTEN") or params["rank_listen"],
                      float(params["collective_timeout_s"]), float(params["rank_form_timeout_s"])),
        max_batch_size=max_batch_size, max_seq_len=int(params["max_seq_len"]),
        threads=int(params.get("cpu_threads") or 1))
    leader.form()
    return leader


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = parameters(cfg)
        self.name = args["model_name"]
        torch.set_num_threads(int(params.get("cpu_threads") or 1))
        # The engine thread holds the GIL for most of a step; with Python's default 5 ms switch
        # interval, execute() and the outbox wait that long for every GIL hand-over, and
        # requests spend more time queued for the GIL than in the batch.
        sys.setswitchinterval(0.0002)
        max_batch_size = int(cfg["max_batch_size"])
        self.leader = form_group(args, params, max_batch_size)
        self.engine = e = build_engine(args, params, max_batch_size, self._on_step, self.leader)
        self.counters = EngineCounters(pb_utils, self.name, e.model)
        self.serving_metrics = ServingMetrics(pb_utils, self.name, max_batch_size)
        # TensorRT-LLM's nv_trt_llm_request_metrics / nv_trt_llm_kv_cache_block_metrics.
        self.trtllm_metrics = TrtllmMetrics(pb_utils, self.name, str(args["model_version"]))
        self._tokens = 0
        self._published = 0.0
        logits = {o["name"]: o["data_type"] for o in cfg["output"]}["context_logits"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.frontend = Frontend(
            pb_utils, self, decoupled=self.decoupled,
            exclude_default=flag(params.get("exclude_input_in_output")), features=contract.CPU,
            limits=checks.Limits(e.model.vocab_size, e.max_input_len, e.max_seq_len),
            logits_dtype=LOGITS_DTYPES[logits])
        self.rank_metrics = None
        if self.leader is not None:
            from moepipe.serving.rank_metrics import RankMetrics

            self.rank_metrics = RankMetrics(pb_utils, self.name, self.leader)
            self.leader.on_health = \
                lambda up, why: self.frontend.outbox.put(self.rank_metrics.publish)
        # metric calls are made on the outbox thread only (see _on_step)
        self.version_metric = VersionMetric(pb_utils, self.name, e.versions.serving)
        # with a rank group, every rank stages its part of a new version (moepipe.ranks)
        where = params.get("control_socket")
        self.control = start_control(where and model_path(args, where), LiveUpdates(
            e, model_path(args, params["checkpoint_dir"]), group=self.leader,
            on_switch=lambda old, new: self.frontend.outbox.put(self.version_metric.set, new)))
        e.start()

    def execute(self, requests):
        self.frontend.execute(requests)
        return None

    def is_ready(self):
        """Model readiness, asked by Triton's readiness endpoints where the Python backend
        supports it (python_backend r26.03+ ``src/python_be.cc``; Triton core r26.04+
        ``src/server.cc`` counts it in ``/v2/health/ready``): False while the rank group is
        lost or forming."""
        return self.leader is None or self.leader.ready

    # -- the serving core's Engine: one GenerationRequest per job -----------------------------
    def make(self, jobs, group):
        return [self._request(job, group) for job in jobs]

    def run(self, reqs):
        self.engine.submit_all(reqs)  # all or none: RequestError, Busy, RankGroupLost
        self.frontend.outbox.put(self.counters.prompt.increment,
                                 sum(len(r.prompt) for r in reqs))

    def stop(self, reqs):
        for req in reqs:  # ended at the engine's next step, with what they generated
            req.stop_requested = True

    def _request(self, job, group):
        row, s = job.row, contract.sampling(job.row, job.sequence)
        bias = row.embedding_bias
        req = GenerationRequest(
            prompt=row.prompt, max_new_tokens=row.max_new_tokens, end_id=row.end_id,
            sampling=SamplingParams(s.temperature, s.top_k, s.top_p, s.seed),
            min_tokens=row.min_tokens, repetition_penalty=row.repetition_penalty,
            presence_penalty=row.presence_penalty, frequency_penalty=row.frequency_penalty,
            stop_words=row.stop_words, bad_words=row.bad_words,
            return_log_probs=row.return_log_probs, streaming=row.streaming,
            embedding_bias=torch.from_numpy(bias.copy()) if bias is not None else None,
            is_cancelled=group.cancelled, return_context_logits=row.return_context_logits,
            return_generation_logits=row.return_generation_logits,
            weights_version=requested_version(job.parameters))
        sent_first = []

        # Called on the engine thread: snapshot what the response needs; the core builds and
        # sends it on the outbox thread so the engine never waits for the server.
        def on_tokens(tokens, log_probs, final):
            self._tokens += len(tokens) if req.streaming else len(req.generated)
            shown, shown_lp = responses.visible(row, tokens, log_probs, final)
            kept = len(req.generated) - (len(tokens) - len(shown))
            ctx = None
            if req.context_logits is not None and not sent_first:
                ctx = req.context_logits.float().numpy()
            sent_first.append(True)
            gen = None
            if req.return_generation_logits:
                steps = req.generation_logits[kept - len(shown):kept]
                gen = (torch.stack(steps).float().numpy() if steps
                       else np.zeros((0, self.engine.model.vocab_size), np.float32))
            perf = _perf(req) if row.return_perf_metrics else None
            result = contract.Result(responses.output_tokens(row, shown), list(shown_lp),
                                     float(sum(req.log_probs[:kept])), ctx, gen, perf)
            if final:
                self.serving_metrics.record(req)
            self.frontend.respond(group, job, result, final)

        req.on_tokens = on_tokens
        req.on_error = lambda message: self.frontend.fail(group, message)
        return req

    # -- metrics ----------------------------------------------------------------------------
    def _on_step(self, model, force=False):
        now = time.monotonic()
        if not force and now - self._published < METRICS_PERIOD_S:
            return
        self._published = now
        tokens, self._tokens = self._tokens, 0
        # Numbers are taken here, on the engine thread; the calls into the server are made on
        # the outbox thread only (concurrent metric calls from two threads of one model can
        # crash the Python backend).
        put = self.frontend.outbox.put
        put(self.counters.publish, self.counters.delta(model), tokens, self.engine.active)
        put(self.serving_metrics.publish, self.engine.load())
        put(self.trtllm_metrics.publish, iteration_values(self.engine))
        if self.rank_metrics is not None:
            put(self.rank_metrics.publish)

    def finalize(self):
        if self.control is not None:
            self.control.close()
        self.engine.stop()
        if self.leader is not None:
            self.leader.close()  # the workers stop
        self.frontend.close()
        e = self.engine
        pb_utils.Logger.log_info(
            f"moepipe engine: {e.steps} steps, {e.stats['sequences'] / max(e.steps, 1):.1f} "
            f"sequences per step, {e.stats['prefills']} prefills, "
            f"{e.stats['forward_s']:.2f}s in forward")
        self.serving_metrics.close()
        self.trtllm_metrics.close()
        self.counters.close()
        self.version_metric.close()
        if self.rank_metrics is not None:
            self.rank_metrics.close()


def _perf(req):
    """return_perf_metrics outputs. Times are CLOCK_MONOTONIC nanoseconds (TensorRT-LLM reports
    its steady clock). The cpu target's KV cache is one slot per request and reuses nothing,
    so the block counts count that slot; there is no speculative decoding."""
    return {"kv_cache_alloc_new_blocks": 1, "kv_cache_reused_blocks": 0,
            "kv_cache_alloc_total_blocks": 1, "arrival_time_ns": req.arrival_ns,
            "first_scheduled_time_ns": req.scheduled_ns,
            "first_token_time_ns": req.first_token_ns, "last_token_time_ns": req.last_token_ns,
            "acceptance_rate": 0.0, "total_accepted_draft_tokens": 0, "total_draft_tokens": 0}
