"""moepipe's load driver: asyncio gRPC streaming requests against a Triton text endpoint.

One gRPC stream per request (a new HTTP/2 stream on one shared channel), so every response and
every error belongs to its request without relying on ids. Each request records when it was
sent, each token response, the final response and the server's own output-token count
(``num_output_tokens``; re-tokenizing the text of a random-weight model does not give it).

Two ways to load a server, both bounded by a request count and a deadline:

* closed loop (``concurrency``): N users, each sends its next request when the last one ended;
* open loop (``schedule``): Poisson (or evenly spaced: ``arrival="constant"``) arrivals at
  piecewise-constant rates (steps, bursts); a request that would exceed ``max_inflight`` is
  counted as ``not_sent`` rather than queued on the client, so a slow server cannot turn into
  an unbounded client backlog.

``processes > 1`` splits the load across that many processes (a saturated client would be
mistaken for a slow server); every process reports its CPU time, and the result says how busy
the busiest client process was.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from moepipe.serving.core.errors import BUSY_TEXTS
from moepipe.utils.progress import IDLE, Task, current
from moepipe.validate import http1

# Request outcomes. "rejected": the server refused it as busy (bounded queue); "failed": any
# other server or transport error; "timeout": no final response within the per-request limit;
# "not_sent": the client's own in-flight limit (open loop only).
OUTCOMES = ("ok", "rejected", "failed", "timeout", "not_sent")
# Triton's queue policy and TensorRT-LLM's executor (what every moepipe target answers:
# moepipe.serving.core.errors), and other servers' words for the same.
BUSY_MARKERS = (*(text.lower() for text in BUSY_TEXTS), "server is busy", "busy:",
                "resource_exhausted")


@dataclass
class Sample:
    """One request as the client saw it; times are seconds since the run started."""

    kind: str
    sent: float
    status: str = "failed"
    first: float | None = None  # first response carrying tokens
    done: float | None = None  # final response, error or timeout
    tokens: int = 0  # the server's num_output_tokens, summed over the streamed responses
    input_tokens: int = 0  # the server's num_input_tokens (the prompt as it was tokenized)
    responses: int = 0
    error: str = ""
    # HTTP: when the request's last byte was handed to the socket (connected, written); a
    # load generator that starts its clock later than ``sent`` can be compared from here
    wrote: float | None = None

    @property
    def latency(self) -> float | None:
        return None if self.done is None or self.status != "ok" else self.done - self.sent

    @property
    def ttft(self) -> float | None:
        return None if self.first is None or self.status != "ok" else self.first - self.sent

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency (AIPerf's definition: (latency - TTFT) / (tokens - 1))."""
        if self.status != "ok" or self.first is None or self.done is None or self.tokens < 2:
            return None
        return (self.done - self.first) / (self.tokens - 1)


@dataclass
class Prompt:
    kind: str  # "short" | "long" (long-tail job) or any label
    text: str
    max_tokens: int


@dataclass
class LoadPlan:
    """What to send. Exactly one of ``concurrency`` or ``schedule`` is set."""

    url: str  # host:port of the gRPC (protocol "grpc") or HTTP (protocol "http") endpoint
    prompts: list[Prompt]
    model: str = "ensemble"
    concurrency: int | None = None
    schedule: list[tuple[float, float]] | None = None  # (seconds, requests per second)
    max_requests: int = 1000
    duration_s: float = 60.0  # hard deadline for sending; in-flight requests then drain
    timeout_s: float = 30.0  # per request
    max_inflight: int = 256
    seed: int = 0
    processes: int = 1
    protocol: str = "grpc"  # or "http": Triton's /generate_stream, server-sent events
    arrival: str = "poisson"  # open loop: "poisson" or "constant" (evenly spaced) arrivals


@dataclass
class LoadResult:
    samples: list[Sample]
    wall_s: float
    client_cpu_s: list[float] = field(default_factory=list)  # per client process
    client_wall_s: list[float] = field(default_factory=list)
    t0: float = 0.0  # time.monotonic() of the samples' time 0

    @property
    def client_cpu_max(self) -> float:
        """CPU use of the busiest client process as a fraction of one core."""
        return max((c / w for c, w in zip(self.client_cpu_s, self.client_wall_s, strict=True)
                    if w > 0), default=0.0)


def _bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _request(pb, model: str, rid: str, prompt: Prompt):
    """A ModelInferRequest for the ensemble's text contract, streaming, counting tokens."""
    req = pb.ModelInferRequest(model_name=model, id=rid)
    spec = [("text_input", "BYTES", _bytes_tensor([prompt.text.encode()])),
            ("max_tokens", "INT32", np.array([prompt.max_tokens], np.int32).tobytes()),
            ("stream", "BOOL", b"\x01"),
            ("return_num_output_tokens", "BOOL", b"\x01"),
            ("return_num_input_tokens", "BOOL", b"\x01")]
    for name, dtype, raw in spec:
        t = req.inputs.add()
        t.name, t.datatype = name, dtype
        t.shape.extend([1, 1])
        req.raw_input_contents.append(raw)
    for name in ("text_output", "num_output_tokens", "num_input_tokens"):
        req.outputs.add().name = name
    # Decoupled models may end with an empty response that only carries the final flag.
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


def classify(message: str) -> str:
    low = message.lower()
    return "rejected" if any(m in low for m in BUSY_MARKERS) else "failed"


class _Client:
    def __init__(self, url: str, model: str, timeout_s: float, t0: float):
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.pb = service_pb2
        self.channel = grpc.aio.insecure_channel(
            url, options=[("grpc.max_receive_message_length", 64 << 20),
                          # a restarted server is found again within half a second
                          ("grpc.initial_reconnect_backoff_ms", 100),
                          ("grpc.min_reconnect_backoff_ms", 100),
                          ("grpc.max_reconnect_backoff_ms", 500)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.model, self.timeout_s, self.t0 = model, timeout_s, t0
        self.ids = itertools.count()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def send(self, prompt: Prompt) -> Sample:
        s = Sample(prompt.kind, self.now())
        finished = asyncio.Event()
        req = _request(self.pb, self.model, f"moepipe-{next(self.ids)}", prompt)

        async def requests():
            yield req
            await finished.wait()  # keep the stream open until the final response

        call = self.stub.ModelStreamInfer(requests())
        try:
            await asyncio.wait_for(self._read(call, s), self.timeout_s)
        except asyncio.TimeoutError:
            s.status, s.error = "timeout", f"no final response within {self.timeout_s:g}s"
            call.cancel()
        except Exception as e:  # transport: connection refused, server gone, stream reset
            detail = e.details() if hasattr(e, "details") else str(e)
            s.status, s.error = classify(str(detail)), f"{type(e).__name__}: {detail}"
        finally:
            finished.set()
        if s.done is None:
            s.done = self.now()
        return s

    async def _read(self, call, s: Sample) -> None:
        async for msg in call:
            now = self.now()
            if msg.error_message:
                s.status, s.error, s.done = classify(msg.error_message), msg.error_message, now
                return
            r = msg.infer_response
            s.responses += 1
            for i, out in enumerate(r.outputs):
                raw = r.raw_output_contents[i] if i < len(r.raw_output_contents) else b""
                if out.name == "text_output" and len(raw) > 4 and s.first is None:
                    s.first = now
                elif out.name == "num_output_tokens" and len(raw) >= 4:
                    # streaming: each response counts the ids it carries (TensorRT-LLM's
                    # contract), so the request's tokens are the sum
                    s.tokens += int(np.frombuffer(raw, np.int32)[0])
                elif out.name == "num_input_tokens" and len(raw) >= 4:
                    s.input_tokens = max(s.input_tokens, int(np.frombuffer(raw, np.int32)[0]))
            final = r.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                s.status, s.done = "ok", now
                return
        s.status, s.error, s.done = "failed", "the stream ended without a final response", \
            self.now()

    async def close(self) -> None:
        await self.channel.close()


class _HttpClient:
    """Triton's generate extension over HTTP/1.1 (``/v2/models/<model>/generate_stream``,
    server-sent events), one connection per request: what HTTP load generators such as
    AIPerf's template endpoint send."""

    def __init__(self, url: str, model: str, timeout_s: float, t0: float):
        host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
        self.host, self.port, self.model = host, int(port), model
        self.timeout_s, self.t0 = timeout_s, t0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def send(self, prompt: Prompt) -> Sample:
        s = Sample(prompt.kind, self.now())
        body = json.dumps({"text_input": prompt.text, "max_tokens": prompt.max_tokens,
                           "stream": True, "return_num_output_tokens": True,
                           "return_num_input_tokens": True}).encode()
        try:
            await asyncio.wait_for(self._exchange(body, s), self.timeout_s)
        except asyncio.TimeoutError:
            s.status, s.error = "timeout", f"no final response within {self.timeout_s:g}s"
        except (OSError, ValueError) as e:  # refused, reset, a malformed answer
            s.status, s.error = classify(str(e)), f"{type(e).__name__}: {e}"
        if s.done is None:
            s.done = self.now()
        return s

    async def _exchange(self, body: bytes, s: Sample) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(f"POST /v2/models/{self.model}/generate_stream HTTP/1.1\r\n"
                         f"Host: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                         + body)
            await writer.drain()
            s.wrote = self.now()
            code, headers = await http1.read_head(reader)
            if code != 200:  # refused before streaming: one JSON error
                error = http1.error_text(await http1.read_body(reader, headers)) or \
                    f"HTTP {code}"
            else:
                error = await self._events(reader, headers, s)
            if error:
                s.status, s.error, s.done = classify(error), error, self.now()
            elif s.responses:
                s.status = "ok"
            else:
                s.status, s.error = "failed", "the stream ended without a response"
        finally:
            writer.close()

    async def _events(self, reader: asyncio.StreamReader, headers: dict[str, str],
                      s: Sample) -> str:
        """Record the streamed responses on ``s``; the text of an error event, if one came."""
        async for event in http1.json_events(reader, headers):
            if "error" in event:
                return str(event["error"]) or "error"
            now = self.now()
            s.responses += 1
            s.done = now
            if event.get("text_output") and s.first is None:  # TTFT: the first non-empty event
                s.first = now
            n = event.get("num_output_tokens")
            n = n[0] if isinstance(n, list) else n
            if n is not None:  # per response when streaming, as over gRPC
                s.tokens += int(n)
            n = event.get("num_input_tokens")
            n = n[0] if isinstance(n, list) else n
            if n is not None:
                s.input_tokens = max(s.input_tokens, int(n))
        return ""

    async def close(self) -> None:
        """Nothing to close: every request has its own connection."""


def _prompt_cycle(prompts: list[Prompt], seed: int):
    rng = random.Random(seed)
    order = list(prompts)
    while True:
        rng.shuffle(order)
        yield from order


def _stopped(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()


async def _closed(plan: LoadPlan, client: _Client, deadline: float,
                  stop: threading.Event | None = None, meter: Task = IDLE) -> list[Sample]:
    samples: list[Sample] = []
    prompts = _prompt_cycle(plan.prompts, plan.seed)
    budget = itertools.count()

    async def user():
        while client.now() < deadline and not _stopped(stop) and \
                next(budget) < plan.max_requests:
            samples.append(await client.send(next(prompts)))
            meter.advance()

    await asyncio.gather(*(user() for _ in range(plan.concurrency or 1)))
    return samples


async def _open(plan: LoadPlan, client: _Client, deadline: float,
                stop: threading.Event | None = None, meter: Task = IDLE) -> list[Sample]:
    rng = random.Random(plan.seed)
    prompts = _prompt_cycle(plan.prompts, plan.seed + 1)
    samples: list[Sample] = []
    tasks: set[asyncio.Task] = set()

    def finished(task: asyncio.Task) -> None:
        tasks.discard(task)
        samples.append(task.result())
        meter.advance()

    at, sent, start = 0.0, 0, 0.0
    for seconds, rate in plan.schedule or []:
        end = start + seconds
        at = max(at, start)
        while rate > 0 and sent < plan.max_requests:
            at += 1.0 / rate if plan.arrival == "constant" else rng.expovariate(rate)
            if at >= end or at >= deadline or _stopped(stop):
                break
            delay = at - client.now()
            if delay > 0:
                await asyncio.sleep(delay)
            sent += 1
            prompt = next(prompts)
            if len(tasks) >= plan.max_inflight:
                samples.append(Sample(prompt.kind, client.now(), "not_sent", done=client.now(),
                                      error=f"client in-flight limit {plan.max_inflight}"))
                meter.advance()
                continue
            task = asyncio.create_task(client.send(prompt))
            tasks.add(task)
            task.add_done_callback(finished)
        start = end
    if tasks:
        await asyncio.gather(*tasks)
    return samples


def _run_one(plan: LoadPlan, t0: float, stop: threading.Event | None = None,
             meter: Task = IDLE) -> tuple[list[Sample], float, float]:
    """Run a plan in this process (counting each request done in ``meter``); returns
    samples, CPU seconds and wall seconds."""
    async def main():
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        kind = _HttpClient if plan.protocol == "http" else _Client
        client: _Client | _HttpClient = kind(plan.url, plan.model, plan.timeout_s, t0)
        try:
            if plan.concurrency is not None:
                return await _closed(plan, client, plan.duration_s, stop, meter)
            return await _open(plan, client, plan.duration_s, stop, meter)
        finally:
            await client.close()

    ru = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.monotonic()
    samples = asyncio.run(main())
    ru2 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru2.ru_utime - ru.ru_utime) + (ru2.ru_stime - ru.ru_stime)
    return samples, cpu, time.monotonic() - wall





def _share(plan: LoadPlan, i: int, n: int) -> LoadPlan:
    """Process i's part of the load: 1/n of the users, rate and request budget."""
    part = replace(plan, processes=1, seed=plan.seed + 7919 * i,
                   max_requests=plan.max_requests // n + (i < plan.max_requests % n),
                   max_inflight=max(1, plan.max_inflight // n))
    if plan.concurrency is not None:
        part.concurrency = plan.concurrency // n + (i < plan.concurrency % n)
    else:
        part.schedule = [(s, r / n) for s, r in plan.schedule or []]
        first = next((r for _, r in plan.schedule or [] if r > 0), 0.0)
        if plan.arrival == "constant" and first > 0 and i:
            # evenly spaced over all processes, not in lockstep: process i starts i/n of its
            # interval later (a leading step at rate 0)
            part.schedule.insert(0, (i / first, 0.0))
    return part


def run_load(plan: LoadPlan, stop: threading.Event | None = None) -> LoadResult:
    """Run a plan to completion (it stops by itself: request budget, deadline, timeouts).
    ``stop``, when set, ends the sending early (in-flight requests drain); one process only:
    worker processes run their whole plan."""
    if (plan.concurrency is None) == (plan.schedule is None):
        raise ValueError("a load plan needs exactly one of concurrency or schedule")
    if plan.arrival not in ("poisson", "constant"):
        raise ValueError(f"unknown arrival {plan.arrival!r} (poisson or constant)")
    n = max(1, min(plan.processes, plan.concurrency or plan.processes))
    # the requests count in the caller's progress task (a validation job's): planned now,
    # done as they end; what the deadline left unsent is taken back from the plan
    meter = current()
    meter.plan(plan.max_requests)
    start = time.monotonic()
    if n == 1:
        samples, cpu, wall = _run_one(plan, start, stop, meter)
        meter.plan(len(samples) - plan.max_requests)
        return LoadResult(samples, time.monotonic() - start, [cpu], [wall], start)
    # Worker processes are fresh interpreters fed their part of the plan as JSON: nothing of
    # the caller's state (threads, gRPC channels, __main__) is forked or re-imported.
    t0 = start + 2.0 + 0.5 * n  # every process starts on the same clock (CLOCK_MONOTONIC)
    procs: list[subprocess.Popen] = []
    try:
        parts = _run_workers(plan, n, t0, procs)
    except BaseException:
        # A signal (moepipe.utils.interrupt) or a failed worker: the others stop sending now,
        # not when their plan ends; none outlives the caller.
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
        raise
    samples = sorted((Sample(**s) for p in parts for s in p["samples"]), key=lambda s: s.sent)
    meter.advance(len(samples))  # the processes report once, at their end
    meter.plan(len(samples) - plan.max_requests)
    return LoadResult(samples, time.monotonic() - t0, [p["cpu"] for p in parts],
                      [p["wall"] for p in parts], t0)


def _run_workers(plan: LoadPlan, n: int, t0: float, procs: list[subprocess.Popen]) -> list:
    """Start ``n`` worker processes (appended to ``procs`` as they start) and collect their
    reports."""
    for i in range(n):
        proc = subprocess.Popen([sys.executable, "-m", "moepipe.validate.load"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        if proc.stdin is None:
            raise RuntimeError("a load process has no stdin")
        # one line, flushed: the worker starts on it; communicate() below closes stdin (a
        # stdin closed here made communicate() fail: "I/O operation on closed file")
        proc.stdin.write(json.dumps({"plan": asdict(_share(plan, i, n)), "t0": t0,
                                     "parent": os.getpid()}) + "\n")
        proc.stdin.flush()
    limit = plan.duration_s + plan.timeout_s + 60
    parts = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, t0 + limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"a load process did not finish within {limit:.0f}s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"a load process failed (exit {proc.returncode})")
        parts.append(json.loads(out))
    return parts


def _die_with(parent: int) -> None:
    """End this worker when ``parent`` ends, however it ends (Linux's parent-death signal):
    a load generator must not outlive the run that started it."""
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's clean-up still kills it
        pass
    if os.getppid() != parent:  # it ended before the signal was armed
        os._exit(1)


def _worker() -> None:
    """``python -m moepipe.validate.load``: run the plan on stdin's first line (JSON: plan,
    t0), print samples as JSON.
    SIGTERM ends the sending early, as ``run_load``'s ``stop`` does (in-flight requests drain,
    then the samples are printed): a caller can run a worker alongside another client for as
    long as that one runs. Ctrl-C in a terminal reaches the worker too: it leaves stopping
    to its parent (which kills it), and it dies with its parent."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    job = json.loads(sys.stdin.readline())
    if job.get("parent"):
        _die_with(job["parent"])
    raw = job["plan"]
    raw["prompts"] = [Prompt(**p) for p in raw["prompts"]]
    if raw["schedule"] is not None:
        raw["schedule"] = [tuple(x) for x in raw["schedule"]]
    samples, cpu, wall = _run_one(LoadPlan(**raw), job["t0"], stop)
    sys.stdout.write(json.dumps({"samples": [asdict(s) for s in samples], "cpu": cpu,
                                 "wall": wall}))


if __name__ == "__main__":
    _worker()
