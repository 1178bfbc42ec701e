"""How a request's results become its responses: which tokens a response shows, and which
response carries the FINAL flag.

A Triton request of B rows x N sequences runs as B * N generations; TensorRT-LLM's backend
answers each with its own responses and flags FINAL only the last response of the last one to
finish (``model_instance_state.cc`` ``WaitForResponse``); an error of one generation is a
response of its own and ends only that generation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .contract import Row

# TRITONSERVER_RESPONSE_COMPLETE_FINAL (tritonserver.h), what pb_utils exports under that name.
FINAL = 1


def visible(row: Row, tokens: list[int], log_probs: list[float], final: bool
            ) -> tuple[list[int], list[float]]:
    """New tokens as a response shows them: generation stops at ``end_id`` without returning
    it (nor its log prob), as TensorRT-LLM's executor does; stop words are returned."""
    if final and row.end_id is not None and tokens and tokens[-1] == row.end_id:
        return tokens[:-1], log_probs[:-1]
    return tokens, log_probs


def output_tokens(row: Row, new: list[int]) -> list[int]:
    """``output_ids`` of a response: the prompt first unless excluded; streamed responses never
    repeat it."""
    return list(new) if (row.exclude_input or row.streaming) else row.prompt + list(new)


class Group:
    """The response sender of one Triton request as each of its ``pending`` generations sees
    it: FINAL goes with the final response of the last one to finish, a bare final flag of any
    other is dropped, and nothing is sent after FINAL. ``on_final`` runs once, after FINAL is
    sent. Thread-safe."""

    def __init__(self, sender, pending: int, on_final: Callable[[], None] = lambda: None):
        self.sender, self.pending, self.on_final = sender, pending, on_final
        self._lock = threading.Lock()
        self._done = False

    def send(self, response=None, final: bool = False) -> None:
        """One response of one generation (``final``: its last)."""
        with self._lock:
            if self._done:
                return
            if final:
                self.pending -= 1
            last = final and self.pending <= 0
            self._done = last
        if response is None and not last:
            return
        self.sender.send(response, flags=FINAL if last else 0)
        if last:
            self.on_final()

    def cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())

    @property
    def done(self) -> bool:
        return self._done


class Last:
    """A response sender for a model that answers in ``execute`` (non-decoupled): it keeps the
    last response."""

    response = None

    def is_cancelled(self) -> bool:
        return False

    def send(self, response=None, flags: int = 0) -> None:
        if response is not None:
            self.response = response


class Live:
    """Request id -> what runs for it, so that a ``stop`` request with the same id can end it
    (TensorRT-LLM's ``handleStopRequest``). Thread-safe."""

    def __init__(self) -> None:
        self._items: dict[str, list] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, items: list) -> None:
        if request_id:
            with self._lock:
                self._items.setdefault(request_id, []).extend(items)

    def get(self, request_id: str) -> list:
        with self._lock:
            return list(self._items.get(request_id, []))

    def remove(self, request_id: str, items: list) -> None:
        if not request_id:
            return
        with self._lock:
            left = [x for x in self._items.get(request_id, []) if not any(x is i for i in items)]
            if left:
                self._items[request_id] = left
            else:
                self._items.pop(request_id, None)
