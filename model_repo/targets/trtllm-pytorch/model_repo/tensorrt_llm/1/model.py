"""moepipe `trtllm-pytorch` target: TensorRT-LLM's LLM API (PyTorch backend) as Triton's
``tensorrt_llm`` model, with the tensor contract of the cpu target (input_ids, input_lengths,
request_output_len, end_id, ... -> output_ids, sequence_length, ...).

``initialize`` builds ``tensorrt_llm.LLM(**model.yaml)`` (all keys but ``triton_config``);
tensorrt_llm is imported there, so a server without it fails with one line naming the container
to use. Requests are parsed in ``execute`` and generated as coroutines on one asyncio loop with
``generate_async``: in decoupled mode a streaming request gets one response per new token, every
request ends with a response flagged FINAL (also when it fails), and a cancelled request is
aborted, and so is a running request when a ``stop`` request with its request id arrives
(decoupled mode). A request of batch size B > 1 runs as B generations whose responses carry
``batch_index``, the last one flagged FINAL (decoupled mode; TensorRT-LLM refuses B > 1
otherwise). Sampling settings that are not finite or out of range are refused (INVALID_ARG)
before they reach TensorRT-LLM. The tensors of features this target does not serve (logits,
perf metrics, LoRA, p-tuning, guided decoding) are refused by name.
Stop / bad words of one token go to TensorRT-LLM as token ids; longer ones as their
decoded text, which TensorRT-LLM encodes again.

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

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import expert_statistic  # noqa: E402 - beside this file (moepipe.trtllm.expert_statistic)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often the folder of TensorRT-LLM's expert statistics is looked at until they are written.
STATISTIC_POLL_S = 5.0


class RequestError(ValueError):
    """A request the client can fix (answered as INVALID_ARG)."""


class Busy(RuntimeError):
    """Every slot is taken and deploy.max_queue_size generations wait (answered as
    UNAVAILABLE, in the words of Triton's queue policy: core src/scheduler_utils.cc)."""


# Inputs of TensorRT-LLM's tensor contract this target does not serve: refused when given.
UNSUPPORTED = ("return_context_logits", "return_generation_logits", "return_perf_metrics",
               "prompt_embedding_table", "prompt_vocab_size", "lora_task_id", "lora_weights",
               "lora_config", "guided_decoding_guide_type", "guided_decoding_guide")


def _given(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None or not t.as_numpy().size:
        return False
    value = t.as_numpy().reshape(-1)
    return bool(value[0]) if value.dtype == np.bool_ else True


def _opt(request, name, default=None, kind=float, row=0):
    """Row ``row``'s value of a ``[B, 1]`` input (``default`` when absent)."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    value = t.as_numpy().reshape(-1)
    return kind(value[row if value.size > row else 0]) if value.size else default


def _check_sampling(request, row):
    """Sampling settings that would make a generation step fail (NaN or infinite
    probabilities) or mean nothing are refused at the edge, as on the cpu target: one bad
    request must not fail the other requests of its step."""
    finite = ("temperature", "runtime_top_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "len_penalty")
    for name in finite:
        value = _opt(request, name, row=row)
        if value is not None and not np.isfinite(value):
            raise RequestError(f"{name} must be a finite number, got {value}")
    temperature = _opt(request, "temperature", row=row)
    if temperature is not None and temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    top_p = _opt(request, "runtime_top_p", row=row)
    if top_p is not None and not 0 <= top_p <= 1:
        raise RequestError(f"runtime_top_p must be in [0, 1], got {top_p}")
    top_k = _opt(request, "runtime_top_k", None, int, row)
    if top_k is not None and top_k < 0:
        raise RequestError(f"runtime_top_k must be >= 0, got {top_k}")
    penalty = _opt(request, "repetition_penalty", row=row)
    if penalty is not None and penalty <= 0:
        raise RequestError(f"repetition_penalty must be > 0, got {penalty}")


def _words(request, name, row=0):
    """``[B, 2, n]`` word list (ids row; cumulative end offsets row padded with -1) -> id
    lists of row ``row``."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None or not t.as_numpy().size:
        return []
    arr = t.as_numpy()
    arr = arr.reshape(-1, 2, arr.shape[-1])
    ids, offsets = arr[row if arr.shape[0] > row else 0].tolist()
    words, start = [], 0
    for end in (o for o in offsets if o >= 0):
        words.append(ids[start:end])
        start = end
    return [w for w in words if w]


def _logprob(entry, token):
    """Log probability of a sampled token: a float, or ``{token: Logprob(logprob, rank)}``."""
    return float(entry[token].logprob) if isinstance(entry, dict) else float(entry)


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.exclude_input = params["exclude_input_in_output"].lower() == "true"
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.yaml")
        with open(path) as f:
            llm_args = yaml.safe_load(f)
        triton = llm_args.pop("triton_config")
        if int(triton["max_batch_size"]) != int(cfg["max_batch_size"]) \
                or bool(triton["decoupled"]) != self.decoupled:
            raise RuntimeError(f"{path}: triton_config {triton} disagrees with config.pbtxt "
                               f"(max_batch_size {cfg['max_batch_size']}, decoupled "
                               f"{self.decoupled}); render the deployment again with "
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
        self.live = {}  # request id -> running generations (a `stop` request aborts them)
        # Generations held (running or waiting in TensorRT-LLM); more than max_batch_size +
        # max_queue_size are refused as busy (0: no bound), as the cpu engine does.
        self.slots, self.max_queue = int(cfg["max_batch_size"]), int(
            params.get("max_queue_size") or 0)
        self.held, self.held_lock = 0, threading.Lock()
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
        jobs = []
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else _Last()
            try:
                if _given(request, "stop"):
                    self._stop(request.request_id(), sender)
                    jobs.append((None, sender))
                    continue
                rows = self._rows(request)
                self._admit(len(rows))
            except Exception as e:  # answered here: execute must not raise in decoupled mode
                code = pb_utils.TritonError.INVALID_ARG if isinstance(e, ValueError) \
                    else pb_utils.TritonError.UNAVAILABLE if isinstance(e, Busy) \
                    else pb_utils.TritonError.INTERNAL
                error = pb_utils.TritonError(str(e), code)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                jobs.append((None, sender))
                continue
            out = _Rows(sender, len(rows)) if len(rows) > 1 else sender
            for job in rows:
                jobs.append((asyncio.run_coroutine_threadsafe(self._serve(job, out), self.loop),
                             sender))
        if self.decoupled:
            return None
        for future, _ in jobs:
            if future is not None:
                future.result()
        return [sender.response for _, sender in jobs]

    def _admit(self, n):
        """Hold ``n`` more generations (the rows of one request, all or none) or raise Busy."""
        with self.held_lock:
            if self.max_queue and self.held and \
                    self.held + n > self.slots + self.max_queue:
                waiting = max(0, self.held - self.slots)
                raise Busy(f"Exceeds maximum queue size: {waiting} requests are waiting for "
                           f"one of {self.slots} slots (deploy.max_queue_size "
                           f"{self.max_queue}); retry later")
            self.held += n

    def _stop(self, request_id, sender):
        """TensorRT-LLM's handleStopRequest: abort the named request; answer the stop request
        with one empty response."""
        if not request_id:
            raise RequestError("Trying to stop a request but request ID is not provided")
        for result in list(self.live.get(request_id, [])):
            self.loop.call_soon_threadsafe(result.abort)
        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)

    def _rows(self, request):
        """One job per row of the request (TensorRT-LLM: one executor request per row)."""
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids is None:
            raise RequestError("input_ids is required")
        ids = ids.as_numpy()
        ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
        if ids.shape[0] > 1 and not self.decoupled:
            raise RequestError("Batch size > 1 requires the tensorrt_llm backend to be using "
                               "decoupled transaction policy")
        for name in UNSUPPORTED:
            if _given(request, name):
                raise RequestError(f"{name} is not supported by the trtllm-pytorch target")
        rows = [self._parse(request, ids[b].tolist(), b) for b in range(ids.shape[0])]
        for job in rows:
            job["batch_size"] = len(rows)
        return rows

    def _parse(self, request, prompt, row):
        prompt = prompt[:_opt(request, "input_lengths", len(prompt), int, row)]
        max_tokens = _opt(request, "request_output_len", 0, int, row)
        if not prompt or max_tokens < 1:
            raise RequestError("input_ids must not be empty and request_output_len must be > 0")
        if _opt(request, "num_return_sequences", 1, int, row) != 1:
            raise RequestError("num_return_sequences > 1 is not supported by the trtllm-pytorch "
                               "target")
        beam = _opt(request, "beam_width", 1, int, row)
        streaming = bool(_opt(request, "streaming", False, bool, row))
        if streaming and (not self.decoupled or beam > 1):
            raise RequestError("streaming needs decoupled mode (deploy.decoupled: true) and "
                               "beam_width 1")
        stop, bad = _words(request, "stop_words_list", row), _words(request, "bad_words_list", row)
        bias = pb_utils.get_input_tensor_by_name(request, "embedding_bias")
        bias = np.zeros(0, np.float32) if bias is None or not bias.as_numpy().size \
            else bias.as_numpy().reshape(-1, bias.as_numpy().shape[-1])[row]
        want_log_probs = bool(_opt(request, "return_log_probs", False, bool, row))
        _check_sampling(request, row)
        sampling = self.SamplingParams(
            max_tokens=max_tokens,
            end_id=_opt(request, "end_id", None, int, row),
            pad_id=_opt(request, "pad_id", None, int, row),
            temperature=_opt(request, "temperature", row=row),
            top_k=_opt(request, "runtime_top_k", None, int, row),
            top_p=_opt(request, "runtime_top_p", row=row),
            seed=_opt(request, "seed", None, int, row),
            min_tokens=_opt(request, "min_tokens", None, int, row),
            repetition_penalty=_opt(request, "repetition_penalty", row=row),
            presence_penalty=_opt(request, "presence_penalty", row=row),
            frequency_penalty=_opt(request, "frequency_penalty", row=row),
            length_penalty=_opt(request, "len_penalty", row=row),
            use_beam_search=beam > 1, n=beam,
            stop_token_ids=[w[0] for w in stop if len(w) == 1] or None,
            stop=[self._text(w) for w in stop if len(w) > 1] or None,
            bad_token_ids=[w[0] for w in bad if len(w) == 1] or None,
            bad=[self._text(w) for w in bad if len(w) > 1] or None,
            embedding_bias=self.torch.from_numpy(bias.astype(np.float32)) if bias.size
            else None,
            logprobs=1 if want_log_probs else None,
            detokenize=False)
        return {"id": request.request_id(), "row": row, "prompt": prompt, "sampling": sampling,
                "streaming": streaming,
                "log_probs": want_log_probs,
                "exclude": bool(_opt(request, "exclude_input_in_output", self.exclude_input,
                                     bool, row)),
                "num_input": bool(_opt(request, "return_num_input_tokens", False, bool, row)),
                "num_output": bool(_opt(request, "return_num_output_tokens", False, bool, row))}

    def _text(self, ids):
        return self.llm.tokenizer.decode(ids)

    async def _serve(self, job, sender):
        done, watch, result = False, None, None
        self.prompt_metric.increment(len(job["prompt"]))
        try:
            result = self.llm.generate_async({"prompt_token_ids": job["prompt"]},
                                             sampling_params=job["sampling"],
                                             streaming=job["streaming"])
            if job["id"]:
                self.live.setdefault(job["id"], []).append(result)
            watch = asyncio.ensure_future(self._watch(result, sender))
            sent = 0
            async for out in result:  # streaming: once per step; else once, when finished
                if job["streaming"]:
                    seq = out.outputs[0]
                    new = seq.token_ids[sent:]
                    for i, token in enumerate(new):
                        done = out.finished and i == len(new) - 1
                        lp = [[_logprob(seq.logprobs[sent + i], token)]] if job["log_probs"] \
                            else None
                        sender.send(self._response(job, [[token]], lp, [seq]),
                                    flags=FINAL if done else 0)
                    sent = len(seq.token_ids)
            if not job["streaming"] and not sender.is_cancelled():  # also after a `stop`
                beams = result.outputs
                tokens = [(job["prompt"] if not job["exclude"] else []) + list(s.token_ids)
                          for s in beams]
                # zip: a matched stop word is cut from token_ids, not from logprobs
                lp = [[_logprob(e, t) for e, t in zip(s.logprobs, s.token_ids, strict=False)]
                      for s in beams] if job["log_probs"] else None
                sender.send(self._response(job, tokens, lp, beams), flags=FINAL)
                done = True
        except Exception as e:  # the client hears about it; the server keeps serving
            if not done:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                            flags=FINAL)
                done = True
        finally:
            with self.held_lock:
                self.held -= 1
            generated = len(result.outputs[0].token_ids) if result is not None \
                and result.outputs else 0
            if generated:
                self.tokens_metric.increment(generated)
            if watch is not None:
                watch.cancel()
            running = self.live.get(job["id"], [])
            if result in running:
                running.remove(result)
                if not running:
                    self.live.pop(job["id"], None)
            if not done:  # cancelled, or finished without a new token
                sender.send(flags=FINAL)

    async def _watch(self, result, sender):
        """Abort the request once the client cancels it."""
        while not result.finished:
            if sender.is_cancelled():
                result.abort()
                return
            await asyncio.sleep(0.1)

    def _response(self, job, tokens, logprobs, beams):
        """One response: ``tokens`` (and ``logprobs``) per beam, padded to ``[1, beams, n]``."""
        pad = job["sampling"].pad_id or 0
        width = max(len(t) for t in tokens)
        tensors = [
            pb_utils.Tensor("output_ids", np.array(
                [[t + [pad] * (width - len(t)) for t in tokens]], np.int32)),
            pb_utils.Tensor("sequence_length", np.array([[len(t) for t in tokens]], np.int32))]
        if job["batch_size"] > 1:
            tensors.append(pb_utils.Tensor("batch_index", np.array([[job["row"]]], np.int32)))
        if logprobs is not None:
            width = max(len(lp) for lp in logprobs)
            tensors += [
                pb_utils.Tensor("cum_log_probs", np.array(
                    [[b.cumulative_logprob or 0.0 for b in beams]], np.float32)),
                pb_utils.Tensor("output_log_probs", np.array(
                    [[lp + [0.0] * (width - len(lp)) for lp in logprobs]], np.float32))]
        if job["num_input"]:
            tensors.append(pb_utils.Tensor("num_input_tokens",
                                           np.array([[len(job["prompt"])]], np.int32)))
        if job["num_output"]:
            tensors.append(pb_utils.Tensor("num_output_tokens",
                                           np.array([[len(beams[0].token_ids)]], np.int32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class _Rows:
    """The sender of a batched request as each row's generation sees it: the FINAL flag goes
    with the final response of the last row to finish (TensorRT-LLM's backend does the same)."""

    def __init__(self, sender, rows):
        self.sender, self.pending, self.lock = sender, rows, threading.Lock()

    def is_cancelled(self):
        return self.sender.is_cancelled()

    def send(self, response=None, flags=0):
        if flags & FINAL:
            with self.lock:
                self.pending -= 1
                last = self.pending == 0
            if not last:
                flags = 0
                if response is None:
                    return
        self.sender.send(response, flags=flags)


class _Last:
    """A response sender for non-decoupled mode: keeps the final response for execute()."""

    response = None

    def is_cancelled(self):
        return False

    def send(self, response=None, flags=0):
        if response is not None:
            self.response = response
