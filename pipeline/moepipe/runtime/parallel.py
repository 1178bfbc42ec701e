"""What one rank's forward needs of the other ranks of a multi-process deployment.

:class:`moepipe.runtime.model.ReferenceModel` without a :class:`Collectives` holds every rank
and sums their partial results itself (the numerical reference, and world size 1). With one, it
holds the tensors of a single rank (its own ``rank{r}.safetensors``) and exchanges activations
where TensorRT-LLM's engines do: an all-reduce over the tensor-parallel group after each
row-parallel output (attention ``dense``, the MoE block, the dense MLP), the vocabulary-parallel
``lm_head`` gathered, hidden states sent from one pipeline stage to the next. Every rank runs
the same sequence of these calls per step; the leader (rank 0) starts each step by telling the
others what the batch is (``begin_step``), and gets the logits from the last stage
(``finish_step``). The implementation over ``torch.distributed`` is :mod:`moepipe.ranks.gloo`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moepipe.runtime.batch import Batch


class Collectives(Protocol):
    """One rank's view of its rank group (see the module docstring)."""

    @property
    def rank(self) -> int: ...

    def begin_step(self, batch: Batch, all_logits: bool, weights: int = 0) -> None:
        """Before the forward: the leader sends the step to the others (``weights``: the id
        of the weights version it runs on, see :mod:`moepipe.serving.live`); no-op
        elsewhere."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over this rank's tensor-parallel group."""

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of every rank of the tensor-parallel group, concatenated on the last dim in
        rank order (the vocabulary-parallel ``lm_head``)."""

    def recv_activations(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The hidden states of the previous pipeline stage (same tensor-parallel rank)."""

    def send_activations(self, h: torch.Tensor) -> None:
        """Hand the hidden states to the next pipeline stage."""

    def finish_step(self, logits: torch.Tensor | None, shape: tuple[int, int]
                    ) -> torch.Tensor | None:
        """After the forward: the leader returns the logits ``shape`` (received from the last
        stage when it is not on it); other ranks return None."""
