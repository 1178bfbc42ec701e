"""``execute`` of a Python ``tensorrt_llm`` model, over any engine.

Each request is parsed (``contract``), checked (``checks``), split into one generation per row
and sequence (``Job``) and handed to the engine whole or not at all; a ``stop`` request ends the
generations of the running request with the same id. Both transaction policies answer through
response senders (non-decoupled: exactly one response), as upstream's Python ``tensorrt_llm``
model does, so ``execute`` never waits and a ``stop`` is served while its target runs. Once a
request runs, its responses and failures are sent on the outbox thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import checks, contract
from .errors import ERR_STOP_WITHOUT_ID, RequestError, is_busy
from .outbox import Outbox
from .responses import FINAL, Group, Live
from .triton import error_response, inputs_of, request_parameters


@dataclass
class Job:
    """One generation: a row of the request and which of its sequences."""

    row: contract.Row
    sequence: int
    batch_size: int
    # the request's Triton parameters (e.g. the weights version it names, on the cpu target)
    parameters: dict = field(default_factory=dict)


class Engine(Protocol):
    """What a target's adapter implements over its engine."""

    def make(self, jobs: list[Job], group: Group) -> list:
        """One handle per job (nothing runs yet); results go to ``Frontend.respond`` /
        ``Frontend.fail`` with ``group``."""

    def run(self, handles: list) -> None:
        """Start them all, or raise (``Busy``, ``RequestError``) and start none."""

    def stop(self, handles: list) -> None:
        """End them at their next step with a final response holding what they have."""


class Frontend:
    """Serves the ``tensorrt_llm`` contract over ``engine`` (``pb_utils``: the Python backend's
    module; ``features``: what the engine honours; ``limits``: what it holds)."""

    def __init__(self, pb_utils: Any, engine: Engine, *, decoupled: bool,
                 exclude_default: bool, features: contract.Features, limits: checks.Limits,
                 logits_dtype=np.float32):
        self.pb, self.engine = pb_utils, engine
        self.decoupled, self.exclude_default = decoupled, exclude_default
        self.features, self.limits, self.logits_dtype = features, limits, logits_dtype
        self.outbox = Outbox(pb_utils.Logger.log_warn)
        self.live = Live()

    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._serve(request, sender)
            except Exception as e:  # answered here: execute must not raise in decoupled mode
                sender.send(error_response(self.pb, e), flags=FINAL)

    def _serve(self, request, sender) -> None:
        """Answers a ``stop`` and raises a refusal on this thread, while no other thread knows
        the sender; from the moment the outbox tracks it, everything goes through the outbox."""
        inputs = inputs_of(request)
        request_id = request.request_id()
        if contract.is_stop(inputs):
            if not request_id:
                raise RequestError(ERR_STOP_WITHOUT_ID)
            self.engine.stop(self.live.get(request_id))
            sender.send(self.pb.InferenceResponse(output_tensors=[]), flags=FINAL)
            return
        rows = contract.parse(inputs, decoupled=self.decoupled,
                              exclude_default=self.exclude_default, features=self.features)
        checks.check_rows(rows, self.limits)
        params = request_parameters(request)
        jobs = [Job(row, seq, len(rows), params) for row in rows
                for seq in range(row.num_return_sequences)]
        tracked = self.outbox.track(sender)
        handles: list = []
        group = Group(tracked, len(jobs), on_final=lambda: self.live.remove(request_id, handles))
        try:
            handles += self.engine.make(jobs, group)
            self.live.add(request_id, handles)
            self.engine.run(handles)
        except Exception as e:  # Busy, or a row the engine refuses: none of them runs
            self.live.remove(request_id, handles)
            self.outbox.put(tracked.send, error_response(self.pb, e), FINAL)

    def respond(self, group: Group, job: Job, result: contract.Result, final: bool) -> None:
        """Send one response of ``job`` (from any thread; built and sent on the outbox's)."""
        self.outbox.put(self._send, group, job, result, final)

    def _send(self, group: Group, job: Job, result: contract.Result, final: bool) -> None:
        arrays = contract.response_arrays(job.row, result, batch_size=job.batch_size,
                                          sequence_index=job.sequence,
                                          logits_dtype=self.logits_dtype)
        tensors = [self.pb.Tensor(name, value) for name, value in arrays.items()]
        group.send(self.pb.InferenceResponse(output_tensors=tensors), final=final)

    def fail(self, group: Group, message: str) -> None:
        """End one generation with an error: UNAVAILABLE when it is a busy refusal (a queue
        timeout), else INTERNAL."""
        code = self.pb.TritonError.UNAVAILABLE if is_busy(message) \
            else self.pb.TritonError.INTERNAL
        response = self.pb.InferenceResponse(error=self.pb.TritonError(message, code))
        self.outbox.put(group.send, response, True)

    def end(self, group: Group) -> None:
        """A generation ended with nothing more to send (cancelled, or stopped mid-stream)."""
        self.outbox.put(group.send, None, True)

    def close(self) -> None:
        self.outbox.stop()
