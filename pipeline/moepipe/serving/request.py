"""A generation request and the logits processing TensorRT-LLM applies to it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moepipe.runtime.sampling import SamplingParams
from moepipe.serving.core import checks
from moepipe.serving.core.errors import RequestError

__all__ = ["GenerationRequest", "RequestError"]


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_new_tokens: int
    end_id: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: torch.Tensor | None = None
    return_log_probs: bool = False
    streaming: bool = False
    # Called from the engine thread: (new tokens, their log-probs, finished) per step when
    # streaming, once with everything when not; on_error(message) ends the request.
    on_tokens: Callable[[list[int], list[float], bool], None] = lambda t, lp, f: None
    on_error: Callable[[str], None] = lambda msg: None
    is_cancelled: Callable[[], bool] = lambda: False
    return_context_logits: bool = False  # keep the prompt's logits ([prompt_len, vocab])
    return_generation_logits: bool = False  # keep each step's raw logits ([vocab] per token)
    # Set by a `stop` request (another thread): the engine ends the request at its next step
    # with a final response carrying what was generated, as TensorRT-LLM's cancelRequest does.
    stop_requested: bool = False
    # The weights version the client asked for (None: the one serving when it is admitted)
    weights_version: str | None = None
    # engine state
    version: str = ""  # the weights version it runs on, from its admission to its end
    weights: Any = None  # that version's model
    generated: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    slot: int = -1
    context_logits: torch.Tensor | None = None
    generation_logits: list[torch.Tensor] = field(default_factory=list)
    # CLOCK_MONOTONIC nanoseconds (return_perf_metrics)
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0

    def validate(self, vocab_size: int, max_input_len: int, max_seq_len: int) -> None:
        """The engine's own guard, in the serving core's words (``checks``); its top_p is
        the sampler's (1.0 = off), so it must be in (0, 1]."""
        checks.check_lengths(len(self.prompt), self.max_new_tokens,
                             checks.Limits(vocab_size, max_input_len, max_seq_len))
        checks.check_token_ids(self.prompt, vocab_size)
        s = self.sampling
        checks.check_sampling(temperature=s.temperature, runtime_top_p=s.top_p,
                              runtime_top_k=s.top_k, repetition_penalty=self.repetition_penalty,
                              presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty)
        if not 0 < s.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {s.top_p}")

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply to the logits: argmax of the raw logits is the token."""
        return (self.sampling.greedy and not self.return_log_probs
                and self.embedding_bias is None and not self.bad_words
                and self.repetition_penalty == 1.0 and not self.presence_penalty
                and not self.frequency_penalty
                and not (self.end_id is not None and self.min_tokens > len(self.generated)))

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Embedding bias, penalties, bad words and min_tokens, as TensorRT-LLM's sampling
        layers apply them."""
        if self.embedding_bias is not None:
            n = min(self.embedding_bias.numel(), logits.numel())
            logits[:n] += self.embedding_bias[:n]
        if (self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty) \
                and (self.prompt or self.generated):
            seen = torch.tensor(self.prompt + self.generated)
            counts = torch.bincount(seen, minlength=logits.numel())[: logits.numel()]
            present = counts > 0
            if self.repetition_penalty != 1.0:
                penalized = torch.where(logits > 0, logits / self.repetition_penalty,
                                        logits * self.repetition_penalty)
                logits = torch.where(present, penalized, logits)
            out_counts = torch.bincount(torch.tensor(self.generated, dtype=torch.long),
                                        minlength=logits.numel())[: logits.numel()] \
                if self.generated else torch.zeros_like(counts)
            logits = logits - self.presence_penalty * (out_counts > 0) \
                - self.frequency_penalty * out_counts
        for word in self.bad_words:
            if len(word) == 1 or self.generated[-(len(word) - 1):] == word[:-1]:
                logits[word[-1]] = float("-inf")
        if self.end_id is not None and len(self.generated) < self.min_tokens:
            logits[self.end_id] = float("-inf")
        return logits

    def finished(self) -> bool:
        if len(self.generated) >= self.max_new_tokens:
            return True
        if self.end_id is not None and self.generated and self.generated[-1] == self.end_id:
            return True
        return any(self.generated[-len(w):] == w for w in self.stop_words if w)
