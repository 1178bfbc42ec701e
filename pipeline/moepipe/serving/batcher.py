"""In-flight batching over the reference runtime.

Requests join and leave the running batch between steps: each step prefills the newly admitted
requests (ragged, in one packed forward) and advances every running request by one token
(one batched decode). Each request owns a KV-cache slot for its lifetime.

Each request runs on one weights version (:mod:`moepipe.serving.versions`) from its admission
to its end; while requests on two versions run (after a live update's switch, or while one is
validated), a step runs one forward per version.

With a rank group (world size > 1) the model is rank 0's and ``health`` its group
(:class:`moepipe.ranks.leader.Leader`): while the group cannot run steps, new requests are
refused and every request in flight ends with :class:`RankGroupLost`'s message (Triton's
UNAVAILABLE); the engine thread then waits for the group to be formed again.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from moepipe.ranks.errors import RankGroupLost
from moepipe.runtime.model import Batch, KVCache, ReferenceModel
from moepipe.runtime.sampling import sample
from moepipe.serving.core.admission import Admission
from moepipe.serving.core.errors import Busy
from moepipe.serving.request import GenerationRequest, RequestError
from moepipe.serving.versions import WeightVersions

log = logging.getLogger("moepipe")
# Cancellation may be a call into the server: asked every few steps, not every step.
CANCEL_CHECK_STEPS = 4


class GroupHealth(Protocol):
    """A rank group as the engine sees it (:class:`moepipe.ranks.leader.Leader`)."""

    def check(self) -> None:
        """Raise :class:`RankGroupLost` unless the group can run steps."""

    def recover(self, stop: threading.Event) -> bool:
        """Block until the group can run steps again (False: ``stop`` was set first)."""


class Batcher:
    def __init__(self, model: ReferenceModel, max_batch_size: int, max_seq_len: int,
                 max_input_len: int | None = None,
                 on_step: Callable[[ReferenceModel, bool], None] | None = None,
                 max_queue_size: int = 0, queue_timeout_s: float = 0.0,
                 admission: Admission | None = None,
                 health: GroupHealth | None = None, version: str = ""):
        self.model = model  # the serving version's (updated between steps)
        self.versions = WeightVersions(model, version)
        self.health = health
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_input_len = max_input_len or max_seq_len
        self.cache = KVCache(model, max_batch_size, max_seq_len)
        self.on_step = on_step
        # max_queue_size requests may wait for a slot (0: any number); more are refused (Busy).
        # A Triton model passes the serving core's copy it ships (its Busy is the one it
        # answers as UNAVAILABLE).
        self.admission = admission or Admission(max_batch_size, max_queue_size,
                                                queue_timeout_s)
        self._incoming: queue.Queue[GenerationRequest | None] = queue.Queue()
        self._waiting: list[GenerationRequest] = []
        self._running: list[GenerationRequest] = []
        self._admitted: list[GenerationRequest] = []  # in the step being run
        self._free = list(range(max_batch_size))
        self._generators: dict[int, torch.Generator] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.stats = {"sequences": 0, "prefills": 0, "forward_s": 0.0}
        self.last_step = (0, 0)  # (scheduled, context) requests of the latest step

    # -- public, thread-safe -------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> None:
        """Queue a request; validation errors are raised here, in the caller's thread."""
        self.submit_all([req])

    def submit_all(self, reqs: list[GenerationRequest]) -> None:
        """Queue the rows of one client request, all or none: validation errors and
        :class:`Busy` (the queue is full) are raised here, in the caller's thread."""
        for req in reqs:
            req.validate(self.model.vocab_size, self.max_input_len, self.max_seq_len)
            pinned = self.versions.pin(req.weights_version)
            if pinned is not None:
                req.version, req.weights = pinned
        if self.health is not None:
            self.health.check()  # RankGroupLost: refused (UNAVAILABLE) while it is down
        self.admission.enter(reqs)
        for req in reqs:
            self._incoming.put(req)

    def wake(self) -> None:
        """Run a step soon even when idle (a switch of versions waits for one)."""
        self._incoming.put(None)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="moepipe-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._incoming.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        queued = []  # submitted but never seen by the engine thread: they get an answer too
        while True:
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                queued.append(item)
        for req in self._waiting + self._running + queued:
            self._fail(req, "the server is shutting down")

    @property
    def active(self) -> int:
        return len(self._running)

    def load(self) -> dict[str, int]:
        """Occupancy for metrics: running and waiting requests, KV-cache slots held, tokens
        held in the KV cache. Exact on the engine thread (``on_step``), a snapshot elsewhere."""
        running = list(self._running)
        return {"running": len(running),
                "waiting": len(self._waiting) + self._incoming.qsize(),
                "slots_used": self.max_batch_size - len(self._free),
                "kv_tokens": sum(len(r.prompt) + len(r.generated) for r in running)}

    def running_tokens(self) -> list[int]:
        """Tokens each running request holds in its KV-cache slot."""
        return [len(r.prompt) + len(r.generated) for r in list(self._running)]

    # -- engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self._running and not self._waiting
            self._drain(block)
            if self._stop.is_set():
                break
            try:
                if self.health is not None:
                    self.health.check()
                self.step()
            except RankGroupLost as e:  # every request in flight ends; then the next group
                self._fail_everything(str(e))
                if self.health is not None:
                    self.health.recover(self._stop)
            except Exception as e:  # a bug: fail the batch (answered, slots freed), keep serving
                log.exception("engine step failed")
                for req in {id(r): r for r in self._admitted + self._running}.values():
                    self._fail(req, f"internal error: {e}")
                self._running, self._admitted = [], []

    def _fail_everything(self, message: str) -> None:
        """End every request the engine holds (running, admitted, waiting, just submitted)."""
        self._drain(False)
        held = {id(r): r for r in self._admitted + self._running + self._waiting}
        self._running, self._admitted, self._waiting = [], [], []
        for req in held.values():
            self._fail(req, message)

    def _drain(self, block: bool) -> None:
        try:
            item = self._incoming.get(timeout=0.5) if block else self._incoming.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._waiting.append(item)
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                break

    def step(self) -> None:
        """Admit what fits, prefill it, then decode one token for every running request."""
        self.model = self.versions.at_step({r.version for r in self._running})
        self._finish_stopped()
        if self.steps % CANCEL_CHECK_STEPS == 0:
            self._drop_cancelled()
        self._expire_waiting()
        admitted: list[GenerationRequest] = []  # out of the queue, not yet running
        self._admitted = admitted  # a failing step fails these with the running ones
        while self._waiting and self._free:
            req = self._waiting.pop(0)
            req.slot = self._free.pop(0)
            req.scheduled_ns = time.monotonic_ns()
            if req.weights is None:  # runs on the version serving now, to its end
                req.version, req.weights = self.versions.serving, self.model
            self._generators[req.slot] = torch.Generator().manual_seed(req.sampling.seed)
            admitted.append(req)
        decoding = list(self._running)
        batch = admitted + decoding  # prompts (prefill) and last tokens (decode), one forward
        if batch:
            self.stats["sequences"] += len(batch)
            self.stats["prefills"] += len(admitted)
            started = time.perf_counter()
            order: list[GenerationRequest] = []
            parts = []
            for model in {id(r.weights): r.weights for r in batch}.values():  # one per version
                new = [r for r in admitted if r.weights is model]
                old = [r for r in decoding if r.weights is model]
                parts.append(self._forward(model, new, old))
                order += new + old
            logits = parts[0] if len(parts) == 1 else torch.cat(parts)
            self.stats["forward_s"] += time.perf_counter() - started
            self._advance(order, logits)
            self._running.extend(r for r in admitted if r.slot >= 0)
        self._running = [r for r in self._running if r.slot >= 0]
        self.last_step = (len(batch), len(admitted))
        self.steps += 1
        if self.on_step is not None:  # told whether the engine is now idle
            self.on_step(self.model, not self._running and not self._waiting)

    def _forward(self, model: ReferenceModel, admitted: list[GenerationRequest],
                 decoding: list[GenerationRequest]) -> torch.Tensor:
        """The next-token logits of ``admitted`` (prefill) then ``decoding`` (one token
        each), on ``model``'s weights."""
        tokens = [t for r in admitted for t in r.prompt] + [r.generated[-1] for r in decoding]
        context = any(r.return_context_logits for r in admitted)
        logits = model.forward(
            Batch(torch.tensor(tokens),
                  [len(r.prompt) for r in admitted] + [1] * len(decoding),
                  [0] * len(admitted) + [len(r.prompt) + len(r.generated) - 1
                                         for r in decoding],
                  [r.slot for r in admitted + decoding]), self.cache, all_logits=context)
        if context:
            logits = self._keep_context_logits(admitted, len(decoding), logits)
        return logits

    def _advance(self, reqs: list[GenerationRequest], logits: torch.Tensor) -> None:
        greedy = logits.argmax(dim=-1).tolist()  # the common case, for the whole batch at once
        now = time.monotonic_ns()
        for req, row, best in zip(reqs, logits, greedy, strict=True):
            if req.return_generation_logits:
                req.generation_logits.append(row.clone())
            req.first_token_ns = req.first_token_ns or now
            req.last_token_ns = now
            if req.plain_greedy:
                token = best
            else:
                try:
                    row = req.process_logits(row.clone())
                    token = sample(row, req.sampling, self._generators[req.slot])
                except (RuntimeError, ValueError) as e:  # this request's alone: fail just it
                    self._fail(req, f"sampling failed: {e}")
                    continue
            req.generated.append(token)
            if req.return_log_probs:
                lp = torch.log_softmax(row.float(), dim=-1)[token].item()
                req.log_probs.append(lp if math.isfinite(lp) else -1e30)
            done = req.finished()
            try:
                if req.streaming:
                    req.on_tokens([token], req.log_probs[-1:], done)
                elif done:
                    req.on_tokens(list(req.generated), list(req.log_probs), True)
            except Exception:  # the client went away; the request ends
                log.exception("sending a response failed")
                done = True
            if done:
                self._release(req)

    @staticmethod
    def _keep_context_logits(admitted: list[GenerationRequest], decoding: int,
                             logits: torch.Tensor) -> torch.Tensor:
        """From the logits of every position: store each admitted prompt's that asks for them;
        return the last position's of every sequence, as a step needs."""
        lens = torch.tensor([len(r.prompt) for r in admitted] + [1] * decoding)
        ends = lens.cumsum(0)
        for req, end, n in zip(admitted, ends.tolist(), lens.tolist(), strict=False):
            if req.return_context_logits:
                req.context_logits = logits[end - n:end].clone()
        return logits[ends - 1]

    def _finish_stopped(self) -> None:
        """End the requests a `stop` request named: a final response with what they have
        (nothing new when streaming)."""
        stopped = [r for r in self._running + self._waiting if r.stop_requested]
        for req in stopped:
            self._release(req)
            if req in self._waiting:
                self._waiting.remove(req)
            try:
                if req.streaming:
                    req.on_tokens([], [], True)
                else:
                    req.on_tokens(list(req.generated), list(req.log_probs), True)
            except Exception:
                log.exception("sending a response failed")
        if stopped:
            self._running = [r for r in self._running if r.slot >= 0]

    def _expire_waiting(self) -> None:
        """Refuse the requests that waited for a slot longer than the queue timeout."""
        if not self.admission.queue_timeout_ns or not self._waiting:
            return
        now = time.monotonic_ns()
        expired = [r for r in self._waiting if self.admission.expired(r, now)]
        for req in expired:
            self._waiting.remove(req)
            self._fail(req, self.admission.timeout_message())

    def _release(self, req: GenerationRequest) -> None:
        """The request ended (or failed): free its slot and its place in the queue bound."""
        self.admission.leave(req)
        if req.slot >= 0:
            self._free.append(req.slot)
            self._generators.pop(req.slot, None)
            req.slot = -1

    def _fail(self, req: GenerationRequest, message: str) -> None:
        self._release(req)
        try:
            req.on_error(message)
        except Exception:
            log.exception("sending an error failed")

    def _drop_cancelled(self) -> None:
        for req in [r for r in self._running + self._waiting if r.is_cancelled()]:
            self._fail(req, "the request was cancelled")
            if req in self._waiting:
                self._waiting.remove(req)
        self._running = [r for r in self._running if r.slot >= 0]


__all__ = ["Batcher", "Busy", "GenerationRequest", "RequestError"]
