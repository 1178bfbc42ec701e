"""The bounded queue of a Python ``tensorrt_llm`` model: how many generations may wait for a
slot, and for how long, before the engine sheds them as busy.

A burst beyond capacity is refused at once instead of queueing without limit. The answers use
Triton's own queue-policy wording and code (UNAVAILABLE; ``errors``), so clients and
``moepipe validate`` recognise them as "busy" exactly as they recognise Triton's dynamic
batcher. TensorRT-LLM's executor bounds the same thing, the requests not yet scheduled
(cpp/tensorrt_llm/executor/executorImpl.cpp ``enqueueRequests``). The cpu engine holds its
requests here (``moepipe.serving.batcher``), the trtllm-pytorch model its generations.
"""

from __future__ import annotations

import threading

from .errors import QUEUE_FULL, QUEUE_TIMEOUT, Busy


class Admission:
    """Counts the requests the engine holds (running or waiting) and refuses new ones once
    every KV-cache slot is taken and ``max_queue_size`` more are waiting (0: no limit).
    Thread-safe: ``enter`` runs on the server's thread, ``leave`` on the engine thread."""

    def __init__(self, slots: int, max_queue_size: int = 0, queue_timeout_s: float = 0.0):
        if slots < 1 or max_queue_size < 0 or queue_timeout_s < 0:
            raise ValueError("slots >= 1, max_queue_size >= 0, queue_timeout_s >= 0")
        self.slots, self.max_queue_size = slots, max_queue_size
        self.queue_timeout_ns = int(queue_timeout_s * 1e9)
        self._held: dict[int, object] = {}  # id -> request (kept alive: ids stay unique)
        self._lock = threading.Lock()
        self.rejected = 0

    @property
    def held(self) -> int:
        return len(self._held)

    def enter(self, reqs: list) -> None:
        """Admit all of ``reqs`` (the rows of one client request) or none: raise Busy."""
        with self._lock:
            limit = self.slots + self.max_queue_size
            # An empty engine takes any request, so one wider than the limit is not refused
            # forever.
            if self.max_queue_size and self._held and len(self._held) + len(reqs) > limit:
                self.rejected += 1
                waiting = max(0, len(self._held) - self.slots)
                raise Busy(f"{QUEUE_FULL}: {waiting} requests are waiting for one of "
                           f"{self.slots} slots (deploy.max_queue_size {self.max_queue_size});"
                           f" retry later")
            self._held.update((id(r), r) for r in reqs)

    def leave(self, req) -> None:
        """``req`` ended (finished, failed, stopped or cancelled); idempotent."""
        with self._lock:
            self._held.pop(id(req), None)

    def expired(self, req, now_ns: int) -> bool:
        """Whether ``req``, still waiting for a slot, has waited longer than the timeout."""
        return bool(self.queue_timeout_ns) and now_ns - req.arrival_ns > self.queue_timeout_ns

    def timeout_message(self) -> str:
        return (f"{QUEUE_TIMEOUT}: waited more than {self.queue_timeout_ns / 1e6:g} ms for a "
                f"slot (deploy.queue_timeout_microseconds); retry later")
