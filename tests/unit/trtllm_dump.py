"""Expert-statistic dumps written the way TensorRT-LLM 1.2 writes them, for the tests.

Upstream: NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/expert_statistic.py``, read at commit
c85e8726 (the 1.2 line: ``os.environ``, ``set_iter`` returns whether it records) and at
0fccc5b9 (main: ``envs.get_env``, ``should_record()``); both write the same files:

* ``EXPERT_STATISTIC_ITER_RANGE`` ``"START-STOP"`` (``span.strip().split('-')``, ``int``);
  iteration ``i`` is recorded when ``START <= i < STOP``;
* ``_maybe_add_info(expert_count, token_selected_experts)``: the first call sets
  ``_meta_info = {"num_experts": expert_count, "num_experts_per_token":
  token_selected_experts.size(-1)}``; ``counts = torch.bincount(ids.flatten(),
  minlength=expert_count)`` (int64) is added under ``f"{iter}_{layer}"``;
* ``_set_iter(STOP)`` writes ``{path}/meta_info.json`` (rank 0 only, ``json.dump``) and
  ``safetensors.torch.save_file(records, f"{path}/rank{rank}.safetensors")``.

The fused MoE modules call ``set_layer(self.layer_idx)`` and ``maybe_add_info(self.num_slots,
token_selected_slots)`` on the tokens the rank holds, before the all-to-all
(``_torch/modules/fused_moe/fused_moe_wide_ep.py``, ``fused_moe_cutlass.py``).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


class Recorder:
    """One rank's ExpertStatistic."""

    def __init__(self, rank: int, span: str, path: str):
        start, stop = span.strip().split("-")
        self.rank, self.start, self.stop, self.path = rank, int(start), int(stop), path
        self.iter = self.layer = None
        self.meta, self.records = None, {}

    def recording(self) -> bool:
        return self.iter is not None and self.start <= self.iter < self.stop

    def set_iter(self, i: int) -> bool:
        self.iter = i
        if i == self.stop:
            os.makedirs(self.path, exist_ok=True)
            if self.rank == 0:
                with open(f"{self.path}/meta_info.json", "w") as f:
                    json.dump(self.meta, f)
            save_file(self.records, f"{self.path}/rank{self.rank}.safetensors")
        return self.recording()

    def set_layer(self, layer: int) -> None:
        self.layer = layer

    def maybe_add_info(self, expert_count: int, selected: torch.Tensor) -> None:
        if not self.recording():
            return
        if self.meta is None:
            self.meta = {"num_experts": expert_count, "num_experts_per_token": selected.size(-1)}
        counts = torch.bincount(selected.flatten(), minlength=expert_count)
        key = f"{self.iter}_{self.layer}"
        if key in self.records:
            self.records[key] += counts.cpu()
        else:
            self.records[key] = counts.cpu()


def simulate(path, *, tp: int, pp: int, attention_dp: bool, layers: list[int], experts: int,
             top_k: int, span: str, tokens: int = 7, seed: int = 0,
             skew: float = 0.0, slots: dict[int, list[int]] | None = None
             ) -> dict[int, torch.Tensor]:
    """Run ``tp x pp`` recorders through iterations 0..STOP with random routing (``skew``
    sends that share of the picks to expert 0) and return the true load of every layer in
    the window (tokens per expert). ``layers`` (decoder indices of the MoE layers) are split
    over the stages in order. ``slots``: the load balancer's slot -> expert lists (counts are
    then per slot, each pick going to one of its expert's slots in turn)."""
    g = torch.Generator().manual_seed(seed)
    start, stop = (int(x) for x in span.split("-"))
    per_stage = -(-len(layers) // pp)
    stage_layers = [layers[s * per_stage:(s + 1) * per_stage] for s in range(pp)]
    recorders = [Recorder(r, span, str(path)) for r in range(tp * pp)]
    truth: dict[int, torch.Tensor] = {}
    turn = 0
    for it in range(stop + 1):
        for rec in recorders:
            rec.set_iter(it)
        for stage in range(pp):
            ranks = recorders[stage * tp:(stage + 1) * tp]
            for layer in stage_layers[stage]:
                shared = _route(g, tokens, experts, top_k, skew)  # attention TP: same tokens
                for rec in ranks:
                    ids = _route(g, tokens + rec.rank, experts, top_k, skew) \
                        if attention_dp else shared
                    if start <= it < stop and (attention_dp or rec is ranks[0]):
                        truth[layer] = truth.get(layer, torch.zeros(experts, dtype=torch.int64)
                                                 ) + torch.bincount(ids.flatten(),
                                                                    minlength=experts)
                    width = experts
                    if slots is not None:
                        ids, turn = _to_slots(ids, slots[layer], turn)
                        width = len(slots[layer])
                    rec.set_layer(layer)
                    rec.maybe_add_info(width, ids)
    return truth


def _route(g, tokens: int, experts: int, top_k: int, skew: float) -> torch.Tensor:
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, 0] += skew
    return scores.topk(top_k, dim=-1).indices.to(torch.int32)


def _to_slots(ids: torch.Tensor, row: list[int], turn: int) -> tuple[torch.Tensor, int]:
    where = {e: [s for s, x in enumerate(row) if x == e] for e in set(row)}
    out = ids.clone()
    for idx in range(ids.numel()):
        choices = where[int(ids.view(-1)[idx])]
        out.view(-1)[idx] = choices[turn % len(choices)]
        turn += 1
    return out, turn
