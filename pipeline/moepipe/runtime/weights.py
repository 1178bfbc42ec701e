"""The reference runtime's weights: a TensorRT-LLM checkpoint's tensors per decoder layer and
tensor-parallel rank, as :mod:`moepipe.runtime.model`'s forward reads them (float32 for compute;
quantized linears dequantized, with their activation quantizers)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from moepipe.errors import CheckpointError
from moepipe.quant import dequant
from moepipe.quant.dequant import ActQuant
from moepipe.runtime import mla
from moepipe.runtime.checkpoint import TrtllmCheckpoint
from moepipe.runtime.mla import MlaDims


@dataclass
class RankLayer:
    """One decoder layer's weights on one tensor-parallel rank."""

    qkv: torch.Tensor | None  # None with multi-head latent attention (Layer.mla)
    qkv_bias: torch.Tensor | None
    dense: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    experts: range  # global ids of this rank's experts
    fc: torch.Tensor  # [E_local, 2*I_r, H], rows = [up | gate]
    proj: torch.Tensor  # [E_local, H, I_r]
    fc_flat: torch.Tensor  # [E_local * 2*I_r, H] (a view of fc)
    proj_flat: torch.Tensor  # [E_local * I_r, H] (proj transposed per expert)
    shared_fc: torch.Tensor | None
    shared_proj: torch.Tensor | None
    heads: int
    kv_heads: int
    # activation quantizers of the linears (quantized checkpoints), and the KV cache's
    aq: dict[str, ActQuant | None] = field(default_factory=dict)
    kv: ActQuant | None = None
    sinks: torch.Tensor | None = None  # [heads_r] softmax sink logits (GPT-OSS)
    window: int = 0  # sliding-window attention over the last `window` positions (0: full)
    fc_bias: torch.Tensor | None = None  # [E_local, 2*I_r] (GPT-OSS experts)
    proj_bias: torch.Tensor | None = None  # [E_local, H], on moe_tp rank 0 only

    def quant(self, which: str, x: torch.Tensor) -> torch.Tensor:
        q = self.aq.get(which)
        return x if q is None else q(x)


@dataclass
class Layer:
    index: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor | None  # [E, H] float32; None: a dense layer (shared_fc is its MLP)
    shared_gate: torch.Tensor | None
    ranks: list[RankLayer]
    router_bias: torch.Tensor | None = None  # [E] (GPT-OSS style routers)
    correction_bias: torch.Tensor | None = None  # [E] selection-only bias (DeepSeek-V3)
    mla: list[mla.MlaRank] | None = None  # multi-head latent attention per tp rank (DeepSeek)
    dense_bias: torch.Tensor | None = None  # [H] attention output bias, after the all-reduce


def _flat(proj: torch.Tensor) -> torch.Tensor:
    """``proj`` [E, H, I] as the rows the sparse expert loop reads: [E * I, H]."""
    return proj.transpose(1, 2).reshape(-1, proj.shape[1]).contiguous()


class Dims(Protocol):
    """The model sizes the loader needs (read from config.json by the model)."""

    @property
    def hidden(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def dense_layers(self) -> int: ...
    @property
    def windows(self) -> list[int]: ...
    @property
    def quant_algo(self) -> str | None: ...
    @property
    def kv_algo(self) -> str | None: ...
    @property
    def mla(self) -> MlaDims | None: ...


class WeightLoader:
    """Reads a checkpoint's tensors into :class:`Layer` objects (float32), with clear errors
    for missing ones.

    Everything it makes from the checkpoint's tensors (a float32 copy, a dequantized weight,
    a transposed one) is remembered with the tensors it was made from. A loader given the
    ``previous`` version's loader (a live weight update) reuses what that one made wherever
    the sources are the very same tensor objects, so the new version holds new memory only
    for what changed."""

    def __init__(self, ckpt: TrtllmCheckpoint, dims: Dims, previous: WeightLoader | None = None):
        self.ckpt = ckpt
        self.dims = dims
        self.made: dict[tuple, tuple[tuple[torch.Tensor, ...], Any]] = {}
        self._previous = previous.made if previous is not None else {}
        self._groups: dict[int, dict[str, tuple[torch.Tensor, ...]]] = {}

    def derived(self, key: tuple, sources: tuple[torch.Tensor, ...], make: Callable[[], Any]):
        """``make()``, or what the previous version made from the same ``sources``."""
        prev = self._previous.get(key)
        if prev is not None and len(prev[0]) == len(sources) \
                and all(a is b for a, b in zip(prev[0], sources, strict=True)):
            result = prev[1]
        else:
            result = make()
        self.made[key] = (sources, result)
        return result

    def finish(self) -> None:
        """Forget the previous version (it may be released while this one serves)."""
        self._previous, self._groups = {}, {}

    def get(self, rank: int, name: str) -> torch.Tensor:
        """A tensor the checkpoint must have (float32); a clear error when it is missing."""
        tensors = self.ckpt.ranks[rank]
        if name not in tensors:
            raise CheckpointError(f"{self.ckpt.path}: rank{rank}.safetensors lacks '{name}'",
                                  "the checkpoint does not match its config.json")
        t = tensors[name]
        return self.derived(("get", rank, name), (t,), t.float)

    def opt(self, rank: int, name: str) -> torch.Tensor | None:
        """A tensor the checkpoint may have (float32), else None."""
        return self.get(rank, name) if name in self.ckpt.ranks[rank] else None

    def linear(self, rank: int, name: str, needed: bool = True):
        """(float weight, activation quantizer) of a linear layer, dequantized if needed."""
        tensors = self.ckpt.ranks[rank]
        if f"{name}.weight" not in tensors:
            if not needed:
                return None, None
            self.get(rank, f"{name}.weight")  # raises the clear error
        return self.derived(("linear", rank, name), self._group(rank, name),
                            partial(dequant.linear, tensors, name, self.dims.quant_algo))

    def _group(self, rank: int, prefix: str) -> tuple[torch.Tensor, ...]:
        """The rank's tensors named ``prefix.<something>`` (a linear's weight and scales)."""
        if rank not in self._groups:
            groups: dict[str, list[torch.Tensor]] = {}
            for n in sorted(self.ckpt.ranks[rank]):
                groups.setdefault(n.rsplit(".", 1)[0], []).append(self.ckpt.ranks[rank][n])
            self._groups[rank] = {k: tuple(v) for k, v in groups.items()}
        return self._groups[rank].get(prefix, ())

    def layer(self, index: int, p: str, ranks: list[int]) -> Layer:
        """Layer ``index`` (checkpoint prefix ``p``) on the tp ranks ``ranks`` of its stage."""
        facts, m, dims = self.ckpt.facts, self.ckpt.mapping, self.dims
        per_rank = []
        heads = self.dims.num_heads // m.tp
        kv_heads = max(1, self.dims.num_kv_heads // m.tp)
        moe = index >= self.dims.dense_layers
        shared = moe and bool(facts.shared_expert_intermediate_size)
        for rank in ranks:
            qkv, qkv_aq = self.linear(rank, p + "attention.qkv", self.dims.mla is None)
            dense, dense_aq = self.linear(rank, p + "attention.dense", self.dims.mla is None)
            if moe:
                fc, fc_aq = self.linear(rank, p + "mlp.fc")
                proj, proj_aq = self.linear(rank, p + "mlp.proj")
                shared_fc, shared_fc_aq = self.linear(rank, p + "mlp.shared_expert.fc", shared)
                shared_proj, shared_proj_aq = self.linear(rank, p + "mlp.shared_expert.proj",
                                                           shared)
            else:  # a dense layer (GatedMLP: fc <- gate_proj, gate <- up_proj) as an ungated
                # shared expert [up | gate] beside no routed experts
                hidden = self.dims.hidden
                fc, proj = torch.zeros(0, 0, hidden), torch.zeros(0, hidden, 0)
                gate = self.get(rank, p + "mlp.gate.weight")
                up = self.get(rank, p + "mlp.fc.weight")
                shared_fc = self.derived(("dense_fc", rank, p), (gate, up),
                                         partial(torch.cat, [gate, up]))
                shared_proj = self.get(rank, p + "mlp.proj.weight")
                fc_aq = proj_aq = shared_fc_aq = shared_proj_aq = None
            per_rank.append(RankLayer(
                qkv=qkv,
                qkv_bias=self.get(rank, p + "attention.qkv.bias") if facts.attn_bias else None,
                dense=dense,
                q_norm=self.get(rank, p + "attention.q_layernorm.weight") if facts.qk_norm
                else None,
                k_norm=self.get(rank, p + "attention.k_layernorm.weight") if facts.qk_norm
                else None,
                experts=m.ep_experts(self.dims.num_experts, rank) if moe else range(0),
                fc=fc, proj=proj, fc_flat=fc.reshape(-1, fc.shape[-1]),
                proj_flat=self.derived(("proj_flat", rank, p), (proj,), partial(_flat, proj)),
                shared_fc=shared_fc if shared or not moe else None,
                shared_proj=shared_proj if shared or not moe else None,
                heads=heads, kv_heads=kv_heads,
                aq={"qkv": qkv_aq, "dense": dense_aq, "fc": fc_aq, "proj": proj_aq,
                    "shared_fc": shared_fc_aq, "shared_proj": shared_proj_aq},
                kv=dequant.kv_quant(self.ckpt.ranks[rank], p + "attention.", self.dims.kv_algo),
                sinks=self.get(rank, p + "attention.sinks") if facts.attention_sinks else None,
                window=self.dims.windows[index] if index < len(self.dims.windows) else 0,
                fc_bias=self.get(rank, p + "mlp.fc.bias") if facts.mlp_bias and moe else None,
                proj_bias=self.get(rank, p + "mlp.proj.bias")
                if facts.mlp_bias and moe and m.moe_tp_rank(rank) == 0 else None))
        r0 = ranks[0]
        return Layer(index=index,
                     input_norm=self.get(r0, p + "input_layernorm.weight"),
                     post_norm=self.get(r0, p + "post_layernorm.weight"),
                     router=self.get(r0, p + "mlp.router.weight") if moe else None,
                     shared_gate=self.get(r0, p + "mlp.shared_expert_gate.weight")
                     if shared and facts.shared_expert_gate else None,
                     ranks=per_rank,
                     router_bias=self.get(r0, p + "mlp.router.bias")
                     if self.ckpt.routing.router_bias else None,
                     correction_bias=self.get(r0, p + "mlp.e_score_correction_bias")
                     if self.ckpt.routing.correction_bias and moe else None,
                     mla=[mla.load_rank(partial(self.get, r), partial(self.opt, r), p, dims.mla)
                          for r in ranks] if dims.mla else None,
                     dense_bias=self.get(r0, p + "attention.dense.bias")
                     if facts.dense_bias else None)
