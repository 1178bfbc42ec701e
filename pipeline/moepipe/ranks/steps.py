"""A step description, as the leader sends it to every worker before each step: what to run
(``Op``) and, for a forward, the packed batch and the weights version it runs on. Every rank
runs the same collectives per step, so every rank must know the batch. A live weight update
(:mod:`moepipe.serving.live`) stages a version on every rank (``STAGE``, its ``detail`` a JSON
object: the checkpoint and the version it is an update of) and drops one (``DISCARD``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from moepipe.runtime.batch import Batch

HEAD = 6  # int64s before the batch or the detail


class Op(IntEnum):
    FORWARD = 1
    STOP = 2  # the leader dissolves the group: the worker exits
    STAGE = 3  # load weights version ``weights`` (its own rank's changed tensors)
    DISCARD = 4  # drop weights version ``weights``


@dataclass
class Step:
    op: Op
    number: int = 0
    batch: Batch | None = None
    all_logits: bool = False
    weights: int = 0  # the weights version's id in its group (moepipe.serving.live)
    detail: str = ""  # STAGE: JSON

    def encode(self) -> bytes:
        b = self.batch
        head = [int(self.op), self.number, int(self.all_logits), self.weights]
        if b is None:
            return np.asarray(head + [0, 0], dtype="<i8").tobytes() + self.detail.encode()
        n_seqs, n_tokens = len(b.seq_lens), int(b.tokens.shape[0])
        parts = [np.asarray(head + [n_seqs, n_tokens], dtype="<i8"),
                 b.tokens.numpy().astype("<i8"),
                 np.asarray(b.seq_lens + b.past_lens + b.slots, dtype="<i8")]
        return b"".join(p.tobytes() for p in parts)

    @classmethod
    def decode(cls, payload: bytes) -> Step:
        op, number, all_logits, weights, n_seqs, n_tokens = (
            int(x) for x in np.frombuffer(payload[:8 * HEAD], dtype="<i8"))
        if op != Op.FORWARD:
            return cls(Op(op), number, weights=weights, detail=payload[8 * HEAD:].decode())
        a = np.frombuffer(payload, dtype="<i8")
        tokens = torch.from_numpy(a[HEAD:HEAD + n_tokens].copy())
        rest = a[HEAD + n_tokens:].tolist()
        batch = Batch(tokens, rest[:n_seqs], rest[n_seqs:2 * n_seqs], rest[2 * n_seqs:])
        return cls(Op.FORWARD, number, batch, bool(all_logits), weights)
