"""moepipe `trtllm-pytorch` target: TensorRT-LLM's LLM API (PyTorch backend) as Triton's
``tensorrt_llm`` model.

A thin adapter. The serving core shipped beside this file (``serving_core``, the renderer's
copy of ``moepipe.serving.core``) serves TensorRT-LLM 1.2's tensor contract exactly as on the
cpu target: rows and sequences, FINAL with the last response, ``stop`` by request id, the same
refusals with the same texts and codes, and the bound on held generations
(``deploy.max_queue_size``). This file drives ``tensorrt_llm.LLM(**model.yaml)`` (all keys but
``triton_config``): each generation is a coroutine on one asyncio loop calling
``generate_async``; a cancelled generation is aborted. tensorrt_llm is imported in
``initialize``, so a server without it fails with one line naming the container to use. Stop /
bad words of one token go to TensorRT-LLM as token ids, longer ones as their decoded text,
which TensorRT-LLM encodes again.

Metrics: ``moepipe_generated_tokens_total{model}``, ``moepipe_prompt_tokens_total{model}``;
with TensorRT-LLM's expert statistics (``expert_statistic_iters``),
``moepipe_expert_tokens_total{model,layer,expert,window}`` once TensorRT-LLM has written the
window's counts (``expert_statistic.py`` beside this file reads them). Metric calls are made on
the request loop's thread only.
"""

import asyncio
import json
import os
import sys
import threading
import time

import triton_python_backend_utils as pb_utils
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import expert_statistic  # noqa: E402 - beside this file (moepipe.trtllm.expert_statistic)
from serving_core import checks, contract, responses  # noqa: E402 - shipped beside this file
from serving_core.admission import Admission  # noqa: E402
from serving_core.frontend import Frontend  # noqa: E402
from serving_core.triton import flag, model_path, parameters  # noqa: E402

# How often the folder of TensorRT-LLM's expert statistics is looked at until they are written.
STATISTIC_POLL_S = 5.0

# How often a running generation looks at its client's cancellation (polled by the outbox).
CANCEL_CHECK_S = 0.1


def _logprob(entry, token):
    """Log probability of a sampled token: a float, or ``{token: Logprob(logprob, rank)}``."""
    return float(entry[token].logprob) if isinstance(entry, dict) else float(entry)


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = parameters(cfg)
        self.decoupled = decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.yaml")
        with open(path) as f:
            llm_args = yaml.safe_load(f)
        triton = llm_args.pop("triton_config")
        # model.yaml names the checkpoint relative to this model's folder (the deployment may
        # have moved since it was rendered); TensorRT-LLM would read it from the server's cwd
        llm_args["model"] = model_path(args, str(llm_args["model"]))
        if int(triton["max_batch_size"]) != int(cfg["max_batch_size"]) \
                or bool(triton["decoupled"]) != decoupled:
            raise RuntimeError(f"{path}: triton_config {triton} disagrees with config.pbtxt "
                               f"(max_batch_size {cfg['max_batch_size']}, decoupled "
                               f"{decoupled}); render the deployment again with "
                               "`moepipe deploy`")
        self.name = args.get("model_name", "tensorrt_llm")
        self.started = time.time() - 1.0  # a dump older than this is an earlier run's
        self._statistic_environment(params)
        try:
            import tensorrt_llm
            import torch
            from tensorrt_llm import LLM, SamplingParams
        except ImportError as e:
            raise RuntimeError(f"TensorRT-LLM cannot be imported by this Triton server ({e}); "
                               f"serve this model repository in {params['trtllm_container']}"
                               ) from None
        if tensorrt_llm.__version__ != params["trtllm_version"]:
            pb_utils.Logger.log_warn(f"TensorRT-LLM {tensorrt_llm.__version__} is installed; "
                                     f"moepipe rendered model.yaml for "
                                     f"{params['trtllm_version']}")
        self.torch, self.SamplingParams = torch, SamplingParams
        self.llm = LLM(**llm_args)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="moepipe-trtllm-requests")
        self.thread.start()
        # Generations held (running or waiting in TensorRT-LLM): max_batch_size + max_queue_size
        # at most (0: no bound), as the cpu engine holds its requests.
        self.admission = Admission(int(cfg["max_batch_size"]),
                                   int(params.get("max_queue_size") or 0))
        self.frontend = Frontend(pb_utils, self, decoupled=decoupled,
                                 exclude_default=flag(params["exclude_input_in_output"]),
                                 features=contract.TRTLLM_PYTORCH, limits=checks.Limits())
        # Families stay referenced: the backend deletes a collected family with its metrics.
        counter = pb_utils.MetricFamily.COUNTER
        self.families = [pb_utils.MetricFamily(name="moepipe_generated_tokens_total",
                                               description="Tokens generated", kind=counter),
                         pb_utils.MetricFamily(name="moepipe_prompt_tokens_total",
                                               description="Prompt tokens of admitted requests",
                                               kind=counter)]
        self.tokens_metric, self.prompt_metric = (f.Metric(labels={"model": self.name})
                                                  for f in self.families)
        self.expert_metrics = []
        if os.environ.get(expert_statistic.ENV_ITER_RANGE):
            asyncio.run_coroutine_threadsafe(self._export_expert_statistic(llm_args), self.loop)

    @property
    def held(self):
        return self.admission.held

    def _statistic_environment(self, params):
        """TensorRT-LLM's workers read EXPERT_STATISTIC_*: the launch path sets them; where the
        server was started without them, they are set here, before tensorrt_llm starts its
        workers (which inherit this environment). A value the server was given wins."""
        window = params.get("expert_statistic_iters") or ""
        if not window:
            return
        for key, value in ((expert_statistic.ENV_ITER_RANGE, window),
                           (expert_statistic.ENV_PATH, params["expert_statistic_path"])):
            given = os.environ.get(key)
            if given is None:
                os.environ[key] = value
            elif given != value:
                pb_utils.Logger.log_warn(f"{key}={given} from the server's environment, not "
                                         f"{value} as rendered")

    async def _export_expert_statistic(self, llm_args):
        """Wait for TensorRT-LLM's expert statistics of this run, then export them."""
        lb = (llm_args.get("moe_config") or {}).get("load_balancer") or {}
        watcher = expert_statistic.DumpWatcher(
            os.environ.get(expert_statistic.ENV_PATH, expert_statistic.DEFAULT_PATH),
            tp=int(llm_args.get("tensor_parallel_size") or 1),
            pp=int(llm_args.get("pipeline_parallel_size") or 1),
            attention_dp=bool(llm_args.get("enable_attention_dp")),
            assignments=lb.get("initial_global_assignments"), started=self.started)
        counts = None
        while counts is None:
            await asyncio.sleep(STATISTIC_POLL_S)
            try:  # file reads off the loop: requests keep being served meanwhile
                counts = await self.loop.run_in_executor(None, watcher.poll)
            except expert_statistic.StatisticError as e:
                pb_utils.Logger.log_warn(f"expert statistics not exported: {e.message} "
                                         f"({e.hint})")
                return
        family = pb_utils.MetricFamily(  # kept in self.families (see initialize)
            name="moepipe_expert_tokens_total",
            description="Tokens routed to each expert of each MoE layer in TensorRT-LLM's "
                        "expert-statistic window (iterations START-STOP)",
            kind=pb_utils.MetricFamily.COUNTER)
        self.families.append(family)
        window = os.environ[expert_statistic.ENV_ITER_RANGE]
        for layer, row in counts.layers.items():
            for e, n in enumerate(row):
                metric = family.Metric(labels={"model": self.name, "layer": str(layer),
                                               "expert": str(e), "window": window})
                metric.increment(n)
                self.expert_metrics.append(metric)
        pb_utils.Logger.log_info(f"expert statistics of iterations {window} exported: "
                                 f"{len(counts.layers)} MoE layers")

    def execute(self, requests):
        self.frontend.execute(requests)
        return None

    # -- the serving core's Engine: one generate_async per job --------------------------------
    def make(self, jobs, group):
        return [_Generation(job, group, self._sampling(job.row)) for job in jobs]

    def run(self, generations):
        self.admission.enter(generations)  # all or none: Busy
        for g in generations:
            asyncio.run_coroutine_threadsafe(self._serve(g), self.loop)

    def stop(self, generations):
        for g in generations:
            g.stopped = True  # one not started yet ends before it starts
            if g.result is not None:
                self.loop.call_soon_threadsafe(g.result.abort)

    def _sampling(self, row):
        def given(name, value):  # TensorRT-LLM's default where the request says nothing
            return value if name in row.given else None

        stop, bad = row.stop_words, row.bad_words
        return self.SamplingParams(
            max_tokens=row.max_new_tokens, end_id=row.end_id, pad_id=row.pad_id,
            temperature=row.temperature, top_k=given("runtime_top_k", row.top_k),
            top_p=given("runtime_top_p", row.top_p), seed=given("seed", row.seed),
            min_tokens=given("min_tokens", row.min_tokens),
            repetition_penalty=given("repetition_penalty", row.repetition_penalty),
            presence_penalty=given("presence_penalty", row.presence_penalty),
            frequency_penalty=given("frequency_penalty", row.frequency_penalty),
            length_penalty=row.len_penalty, use_beam_search=row.beam_width > 1,
            n=row.beam_width,
            stop_token_ids=[w[0] for w in stop if len(w) == 1] or None,
            stop=[self.llm.tokenizer.decode(w) for w in stop if len(w) > 1] or None,
            bad_token_ids=[w[0] for w in bad if len(w) == 1] or None,
            bad=[self.llm.tokenizer.decode(w) for w in bad if len(w) > 1] or None,
            embedding_bias=None if row.embedding_bias is None
            else self.torch.from_numpy(row.embedding_bias),
            logprobs=1 if row.return_log_probs else None, detokenize=False)

    async def _serve(self, g):
        row, streaming, sent, done, watch = g.job.row, g.job.row.streaming, 0, False, None
        self.prompt_metric.increment(len(row.prompt))
        try:
            if g.stopped:  # by a `stop` before it started: what it generated, nothing
                self.frontend.respond(g.group, g.job, self._result(row, []), True)
                done = True
                return
            g.result = self.llm.generate_async({"prompt_token_ids": row.prompt},
                                               sampling_params=g.sampling, streaming=streaming)
            watch = asyncio.ensure_future(self._watch(g))
            async for out in g.result:  # streaming: once per step; else once, when finished
                if streaming:
                    seq = out.outputs[0]
                    new = seq.token_ids[sent:]
                    for i, token in enumerate(new):
                        done = out.finished and i == len(new) - 1
                        lp = [_logprob(seq.logprobs[sent + i], token)] if row.return_log_probs \
                            else []
                        result = contract.Result([token], lp,
                                                 float(seq.cumulative_logprob or 0.0))
                        self.frontend.respond(g.group, g.job, result, done)
                    sent = len(seq.token_ids)
            if not streaming and not g.group.cancelled():  # also after a `stop`
                self.frontend.respond(g.group, g.job, self._result(row, g.result.outputs), True)
                done = True
        except Exception as e:  # the client hears about it; the server keeps serving
            if not done:
                self.frontend.fail(g.group, str(e))
                done = True
        finally:
            self.admission.leave(g)
            generated = len(g.result.outputs[0].token_ids) if g.result is not None \
                and g.result.outputs else 0
            if generated:
                self.tokens_metric.increment(generated)
            if watch is not None:
                watch.cancel()
            if not done:  # cancelled, or finished without a new token
                self.frontend.end(g.group)

    @staticmethod
    def _result(row, beams):
        """The final response of a non-streaming generation: every beam, with the prompt
        unless excluded; log probs zipped with the tokens (a matched stop word is cut from
        token_ids, not from logprobs)."""
        every = [(responses.output_tokens(row, []), [], 0.0)] if not beams else []
        for s in beams:
            tokens = responses.output_tokens(row, list(s.token_ids))
            lp = [_logprob(e, t) for e, t in zip(s.logprobs, s.token_ids, strict=False)] \
                if row.return_log_probs else []
            every.append((tokens, lp, float(s.cumulative_logprob or 0.0)))
        return contract.Result(every[0][0], every[0][1], every[0][2], beams=every)

    async def _watch(self, g):
        """Abort the generation once its client cancels."""
        while not g.result.finished:
            if g.group.cancelled():
                g.result.abort()
                return
            await asyncio.sleep(CANCEL_CHECK_S)

    def finalize(self):
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.frontend.close()


class _Generation:
    """One job's generation: its sampling parameters and, once started, its result."""

    def __init__(self, job, group, sampling):
        self.job, self.group, self.sampling, self.result = job, group, sampling, None
        self.stopped = False
