"""A step description, as the leader sends it to every worker before each step: what to run
(``Op``) and, for a forward, the packed batch. Every rank runs the same collectives per step,
so every rank must know the batch. Future commands (e.g. a weight update) are new ops."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from moepipe.runtime.batch import Batch


class Op(IntEnum):
    FORWARD = 1
    STOP = 2  # the leader dissolves the group: the worker exits


@dataclass
class Step:
    op: Op
    number: int = 0
    batch: Batch | None = None
    all_logits: bool = False

    def encode(self) -> bytes:
        b = self.batch
        head = [int(self.op), self.number, int(self.all_logits)]
        if b is None:
            return np.asarray(head + [0, 0], dtype="<i8").tobytes()
        n_seqs, n_tokens = len(b.seq_lens), int(b.tokens.shape[0])
        parts = [np.asarray(head + [n_seqs, n_tokens], dtype="<i8"),
                 b.tokens.numpy().astype("<i8"),
                 np.asarray(b.seq_lens + b.past_lens + b.slots, dtype="<i8")]
        return b"".join(p.tobytes() for p in parts)

    @classmethod
    def decode(cls, payload: bytes) -> Step:
        a = np.frombuffer(payload, dtype="<i8")
        op, number, all_logits, n_seqs, n_tokens = (int(x) for x in a[:5])
        if op != Op.FORWARD:
            return cls(Op(op), number)
        tokens = torch.from_numpy(a[5:5 + n_tokens].copy())
        rest = a[5 + n_tokens:].tolist()
        batch = Batch(tokens, rest[:n_seqs], rest[n_seqs:2 * n_seqs], rest[2 * n_seqs:])
        return cls(Op.FORWARD, number, batch, bool(all_logits))
