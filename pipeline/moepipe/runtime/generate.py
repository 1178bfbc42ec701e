"""Greedy / sampled generation on the reference runtime (offline: parity checks, validation)."""

from __future__ import annotations

import torch

from moepipe.runtime.model import Batch, KVCache, ReferenceModel
from moepipe.runtime.sampling import SamplingParams, sample


def generate(model: ReferenceModel, prompts: list[list[int]], max_new_tokens: int,
             end_id: int | None = None, sampling: SamplingParams | None = None) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` for every prompt (batched decode, ragged prompts).
    Returns only the new tokens; a sequence stops after emitting ``end_id``."""
    sampling = sampling or SamplingParams()
    cache = KVCache(model, len(prompts), max(len(p) for p in prompts) + max_new_tokens)
    gens = [torch.Generator().manual_seed(sampling.seed + i) for i in range(len(prompts))]
    logits = model.forward(Batch(torch.tensor([t for p in prompts for t in p]),
                                 [len(p) for p in prompts], [0] * len(prompts),
                                 list(range(len(prompts)))), cache)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while active:
        nxt = [sample(logits[i], sampling, gens[s]) for i, s in enumerate(active)]
        still = []
        for s, tok in zip(active, nxt, strict=True):
            outputs[s].append(tok)
            if tok != end_id and len(outputs[s]) < max_new_tokens:
                still.append(s)
        if not still:
            break
        logits = model.forward(Batch(torch.tensor([outputs[s][-1] for s in still]),
                                     [1] * len(still),
                                     [len(prompts[s]) + len(outputs[s]) - 1 for s in still],
                                     still), cache)
        active = still
    return outputs
