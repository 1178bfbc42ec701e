"""The values of a request checked before an engine sees them, with one text per rule.

Where a request enters (every Python ``tensorrt_llm`` model, and the postprocessing model's
token ids) and where the cpu engine guards itself (``moepipe.serving.request``), the same
functions say the same thing. Settings that would make a generation step fail (NaN or infinite
probabilities) or mean nothing are refused at the edge: one bad request must not fail the other
requests of its step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .contract import Row
from .errors import RequestError

# JSON integers above INT32 wrap around in Triton's HTTP frontend before any model sees them.
_WRAPPED = (" (JSON values above 2147483647 wrap around when Triton's HTTP frontend narrows "
            "them to INT32)")


@dataclass(frozen=True)
class Limits:
    """What the engine can hold; None: the engine checks it itself."""

    vocab_size: int | None = None
    max_input_len: int | None = None
    max_seq_len: int | None = None


def check_lengths(prompt_len: int, max_tokens: int, limits: Limits) -> None:
    """A non-empty prompt, at least one token to generate, both within the engine's limits."""
    if prompt_len < 1:
        raise RequestError("the prompt is empty")
    if max_tokens < 1:
        wrapped = _WRAPPED if max_tokens < 0 else ""
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}{wrapped}")
    if limits.max_input_len is not None and prompt_len > limits.max_input_len:
        raise RequestError(f"the prompt has {prompt_len} tokens; the limit is "
                           f"max_input_len={limits.max_input_len}")
    if limits.max_seq_len is not None and prompt_len + max_tokens > limits.max_seq_len:
        raise RequestError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                           f"max_seq_len={limits.max_seq_len}")


def check_token_ids(ids: Iterable[int], vocab_size: int) -> None:
    """Every id names a token of the vocabulary."""
    for token in ids:
        if not 0 <= token < vocab_size:
            raise RequestError(f"token id {token} is outside the vocabulary "
                               f"(0..{vocab_size - 1})")


def check_sampling(*, temperature: float | None = None, runtime_top_p: float | None = None,
                   runtime_top_k: int | None = None, repetition_penalty: float | None = None,
                   presence_penalty: float | None = None, frequency_penalty: float | None = None,
                   len_penalty: float | None = None) -> None:
    """The sampling settings of a request, named as the tensorrt_llm model's inputs (None: not
    given). runtime_top_p <= 0 means no top-p, as TensorRT-LLM reads it."""
    given = {"temperature": temperature, "runtime_top_p": runtime_top_p,
             "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
             "frequency_penalty": frequency_penalty, "len_penalty": len_penalty}
    for name, value in given.items():
        if value is not None and not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number, got {value}")
    if temperature is not None and temperature < 0:
        raise RequestError(f"temperature must be a finite number >= 0, got {temperature}")
    if runtime_top_p is not None and runtime_top_p > 1:
        raise RequestError(f"runtime_top_p must be in [0, 1], got {runtime_top_p}")
    if runtime_top_k is not None and runtime_top_k < 0:
        raise RequestError(f"runtime_top_k must be >= 0, got {runtime_top_k}")
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise RequestError(f"repetition_penalty must be > 0, got {repetition_penalty}")


def check_row(row: Row, limits: Limits) -> None:
    """Everything about one row an engine would otherwise fail on, in the order a client fixes
    it: lengths, token ids, sampling."""
    check_lengths(len(row.prompt), row.max_new_tokens, limits)
    if limits.vocab_size is not None:
        check_token_ids(row.prompt, limits.vocab_size)
    check_sampling(temperature=row.temperature, runtime_top_p=row.top_p,
                   runtime_top_k=row.top_k, repetition_penalty=row.repetition_penalty,
                   presence_penalty=row.presence_penalty,
                   frequency_penalty=row.frequency_penalty, len_penalty=row.len_penalty)


def check_rows(rows: list[Row], limits: Limits) -> None:
    """Every row of a request is checked before any runs."""
    for row in rows:
        check_row(row, limits)
