"""Clients that send requests without pause to a deployment's ``tensorrt_llm`` model (gRPC,
greedy token ids) and record every answer: what the live-update test and benchmark measure
an update under (failures, the longest gap between two answers, latency percentiles)."""

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from moepipe.validate import client

RETRY_S = 0.1  # a failed client's pause before it opens a new stream


@dataclass
class Answer:
    prompt: int  # index into the prompts
    started: float  # time.monotonic()
    ended: float
    tokens: list[int] | None  # None: the request failed
    error: str = ""

    @property
    def latency(self) -> float:
        return self.ended - self.started


@dataclass
class Load:
    """``clients`` threads, each sending one request after another until :meth:`stop`."""

    grpc: str
    prompts: list[list[int]]
    max_tokens: int
    clients: int = 4
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "Load":
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> list[Answer]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        return sorted(self.answers, key=lambda a: a.ended)

    def _client(self, index: int) -> None:
        """Requests one after another on one stream; after a failure (a server that went
        away) a new stream, RETRY_S later: what a client retrying a restarted server does."""
        n = index
        while not self._stop.is_set():
            try:
                with client.GrpcStream(self.grpc, timeout=30) as stream:
                    while not self._stop.is_set():
                        p = n % len(self.prompts)
                        n += 1
                        answer = self._one(stream, p)
                        with self._lock:
                            self.answers.append(answer)
                        if answer.tokens is None:
                            break
            except Exception as e:  # no server to open a stream to (tritonclient's errors)
                with self._lock:
                    now = time.monotonic()
                    self.answers.append(Answer(n % len(self.prompts), now, now, None, str(e)))
            self._stop.wait(RETRY_S)

    def _one(self, stream: client.GrpcStream, p: int) -> Answer:
        ids = self.prompts[p]
        inputs = {"input_ids": np.array([ids], np.int32),
                  "input_lengths": np.array([[len(ids)]], np.int32),
                  "request_output_len": np.array([[self.max_tokens]], np.int32),
                  "exclude_input_in_output": np.array([[True]], np.bool_)}
        started = time.monotonic()
        try:
            res = stream.infer("tensorrt_llm", inputs, ["output_ids", "sequence_length"])
            out = res.outputs[-1]
            length = int(out["sequence_length"].reshape(-1)[0])
            return Answer(p, started, time.monotonic(),
                          out["output_ids"].reshape(-1)[:length].tolist())
        except client.ClientError as e:
            return Answer(p, started, time.monotonic(), None, str(e))


def longest_gap(answers: list[Answer], start: float, end: float) -> float:
    """The longest time in [start, end] without a successful answer."""
    times = [start] + sorted(a.ended for a in answers if a.tokens is not None
                             and start <= a.ended <= end) + [end]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")
