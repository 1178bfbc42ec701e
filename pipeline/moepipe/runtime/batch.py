"""The packed batch every rank's forward runs: tokens of several sequences concatenated, each
sequence with its cache slot and the number of tokens already cached (ragged prefill and
batched decode share one ``forward``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Packed tokens: ``tokens`` holds ``seq_lens[i]`` new tokens of sequence i, whose cache slot
    ``slots[i]`` already holds ``past_lens[i]`` tokens."""

    tokens: torch.Tensor
    seq_lens: list[int]
    past_lens: list[int]
    slots: list[int]

    @classmethod
    def single(cls, tokens: list[int], past: int = 0, slot: int = 0) -> Batch:
        return cls(torch.tensor(tokens, dtype=torch.long), [len(tokens)], [past], [slot])
