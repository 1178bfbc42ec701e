"""The reference runtime: a TensorRT-LLM checkpoint run on CPU with torch, rank by rank.

Every tensor-parallel rank computes with its own shard and the partial results are summed, as
TensorRT-LLM's all-reduce does: attention heads per rank, row-parallel dense output, experts of
the rank's EP group on its slice of the expert FFN, shared expert split over tp, vocab-parallel
``lm_head`` gathered. Pipeline stages run one after the other. Weights are the checkpoint's own
(cast to float32 for compute), so parity with Hugging Face proves the converter and the config.

The batch interface is *packed* (:class:`moepipe.runtime.batch.Batch`): ragged prefill and
batched decode share one ``forward``.

Given :class:`moepipe.runtime.parallel.Collectives`, the model holds one rank only (its own
tensors, its own layers and KV cache) and the sums over ranks become all-reduces among the rank
processes: the same code path, so the single-process model stays the numerical reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moepipe.errors import CheckpointError
from moepipe.mapping import stage_layers
from moepipe.runtime import mla
from moepipe.runtime.activations import expert_activation
from moepipe.runtime.attention_ext import attend, projection_qk_norm, window_mask
from moepipe.runtime.batch import Batch
from moepipe.runtime.checkpoint import TrtllmCheckpoint
from moepipe.runtime.moe import experts_dense, experts_sparse, shared_expert
from moepipe.runtime.parallel import Collectives
from moepipe.runtime.routing import RouteFn, route_op
from moepipe.runtime.weights import Layer, RankLayer, WeightLoader

# MoE strategy by work size (multiply-adds of a layer's experts on this batch): all experts
# densely, zero-weighting the unselected, while that is cheap (tiny models, decode steps);
# else one loop over the selected experts.
DENSE_LIMIT = 1 << 24


@dataclass
class _AttentionPlan:
    """How a packed batch's attention is computed: single-token sequences with a cache in one
    batched call (decode), the others one sequence at a time (prefill)."""

    decode: tuple | None  # (token indices, slots, past lengths, key length, mask)
    prefill: list[tuple[int, int, int, int]]  # (start, n, past, slot)

    @classmethod
    def of(cls, batch: Batch, cache: KVCache | None) -> _AttentionPlan:
        starts = [0]
        for n in batch.seq_lens[:-1]:
            starts.append(starts[-1] + n)
        seqs = list(zip(starts, batch.seq_lens, batch.past_lens, batch.slots, strict=True))
        if cache is None:
            if any(past for _, _, past, _ in seqs):
                raise ValueError("a sequence with cached tokens needs the cache")
            return cls(None, seqs)
        single = [s for s in seqs if s[1] == 1]
        decode = None
        if single:
            past = torch.tensor([s[2] for s in single])
            length = int(past.max()) + 1
            decode = (torch.tensor([s[0] for s in single]), torch.tensor([s[3] for s in single]),
                      past, length,
                      (torch.arange(length)[None, :] <= past[:, None])[:, None, None, :])
        return cls(decode, [s for s in seqs if s[1] != 1])


class KVCache:
    """Per-slot key/value cache of the model's layers (by layer index), one tensor per tp rank
    it holds (a rank process: its own)."""

    def __init__(self, model: ReferenceModel, num_slots: int, max_len: int):
        self.num_slots, self.max_len = num_slots, max_len
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}
        for layer in model.layers:
            if model.mla is not None:  # one latent per token, shared by the tp ranks
                self.k[layer.index] = [torch.zeros(num_slots, 1, max_len, model.mla.cache_width)]
                self.v[layer.index] = []
                continue
            shape = [(num_slots, r.kv_heads, max_len, model.head_size) for r in layer.ranks]
            self.k[layer.index] = [torch.zeros(s) for s in shape]
            self.v[layer.index] = [torch.zeros(s) for s in shape]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ReferenceModel:
    """Forward passes over a loaded :class:`TrtllmCheckpoint`: of every rank, or with ``comm``
    of the rank ``comm.rank`` alone (``ckpt`` needs only that rank's tensors).

    ``previous``: the version of the same model this one replaces (a live weight update):
    every float32 tensor made from the same checkpoint tensor objects is shared with it, and
    so are the expert counters."""

    def __init__(self, ckpt: TrtllmCheckpoint, router: RouteFn = route_op,
                 comm: Collectives | None = None, previous: ReferenceModel | None = None):
        self.ckpt = ckpt
        self.route = router
        self.comm = comm
        cfg = ckpt.config
        self.mapping = m = ckpt.mapping
        self.hidden = int(cfg["hidden_size"])
        self.num_heads = int(cfg["num_attention_heads"])
        self.num_kv_heads = int(cfg.get("num_key_value_heads") or self.num_heads)
        self.head_size = int(cfg.get("head_size") or self.hidden // self.num_heads)
        self.eps = float(cfg.get("norm_epsilon", 1e-5))
        self.vocab_size = ckpt.vocab_size
        self.num_experts = ckpt.routing.num_experts
        quant = cfg.get("quantization") or {}
        self.quant_algo = quant.get("quant_algo")
        self.kv_algo = quant.get("kv_cache_quant_algo")
        self.mla = mla.MlaDims.from_config(cfg)
        self.mla_absorbed = True  # False: the plain formulation (same numbers; tests)
        self.dense_layers = int(cfg.get("first_k_dense_replace") or 0) if self.mla else 0
        rot_dim = int(cfg.get("rotary_embedding_dim") or self.head_size)
        base = float(cfg.get("rotary_base", 10000.0))
        self.inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float()
                                        / rot_dim))
        self.rope_factor = 1.0  # cos/sin factor (YaRN)
        if cfg.get("rotary_scaling"):
            self.inv_freq, self.rope_factor = mla.yarn(rot_dim, base, cfg["rotary_scaling"])
        self.act = expert_activation(cfg)
        self.windows = [int(cfg.get("sliding_window") or 0) if t == "sliding_attention" else 0
                        for t in cfg.get("layer_types") or ()]
        if rot_dim != (self.mla.qk_rope_head_dim if self.mla else self.head_size):
            raise CheckpointError("partial rotary embeddings are not implemented")
        load = WeightLoader(ckpt, self, previous.loader if previous is not None else None)
        # every stage and tp rank, or the one rank of this process
        stages = range(m.pp) if comm is None else [m.pp_rank(comm.rank)]
        tp_ranks = range(m.tp) if comm is None else [m.tp_rank(comm.rank)]
        self.first_stage, self.last_stage = 0 in stages, m.pp - 1 in stages
        self.layers: list[Layer] = []
        for stage in stages:
            stage_ranks = [stage * m.tp + t for t in tp_ranks]
            for local, index in enumerate(stage_layers(ckpt.num_layers, m.pp, stage)):
                self.layers.append(load.layer(index, f"transformer.layers.{local}.", stage_ranks))
        first = min(stages) * m.tp + tp_ranks[0]  # the embedding is on every rank of stage 0
        last = max(stages) * m.tp
        self.embedding = load.get(first, "transformer.vocab_embedding.weight") \
            if self.first_stage else None
        self.ln_f = load.get(last + tp_ranks[0], "transformer.ln_f.weight") \
            if self.last_stage else None
        self.lm_head = [load.get(last + t, "lm_head.weight") for t in tp_ranks] \
            if self.last_stage else []
        load.finish()
        self.loader: WeightLoader = load  # what the next version reuses
        # which weights version this is within its rank group (0: the one loaded first): the
        # other ranks run each step on their part of the same version
        self.weights_id = 0
        self.expert_tokens: torch.Tensor = (
            previous.expert_tokens if previous is not None
            else torch.zeros(ckpt.num_layers, self.num_experts, dtype=torch.long))

    # -- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: Batch, cache: KVCache | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Logits of the last token of each sequence ``[num_seqs, vocab]`` (or of every token
        with ``all_logits``). With a cache, new keys/values are stored in the sequences' slots.
        """
        logits = self.run(batch, cache, all_logits)
        if logits is None:
            raise CheckpointError("no logits on this rank: only the leader (rank 0) of a rank "
                                  "group gets them")
        return logits

    @torch.inference_mode()
    def run(self, batch: Batch, cache: KVCache | None = None,
            all_logits: bool = False) -> torch.Tensor | None:
        """:meth:`forward` of any rank: the logits, or None on a rank process other than the
        leader."""
        comm = self.comm
        if comm is not None:
            comm.begin_step(batch, all_logits, self.weights_id)
        positions = torch.cat([torch.arange(p, p + n) for p, n in
                               zip(batch.past_lens, batch.seq_lens, strict=True)])
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        f = self.rope_factor
        cos, sin = f * emb.cos()[:, None, :], f * emb.sin()[:, None, :]
        if self.embedding is not None:
            h = self.embedding[batch.tokens]
        elif comm is not None:
            h = comm.recv_activations((batch.tokens.shape[0], self.hidden))
        else:
            raise CheckpointError("no embedding: the model holds no first pipeline stage")
        plan = _AttentionPlan.of(batch, cache)
        for layer in self.layers:
            x = rms_norm(h, layer.input_norm, self.eps)
            if layer.mla is not None and self.mla is not None:
                attn = self._reduce(mla.attention(x, layer.mla, self.mla, cos, sin, plan,
                                                  cache.k[layer.index][0] if cache else None,
                                                  self.mla_absorbed))
            else:
                attn = self._gqa(x, layer, cos, sin, plan, cache)
            h = h + attn
            x = rms_norm(h, layer.post_norm, self.eps)
            h = h + self._reduce(self._moe(x, layer))
        rows = h.shape[0] if all_logits else len(batch.seq_lens)
        logits = None
        if self.ln_f is not None:
            if not all_logits:
                last = torch.tensor(batch.seq_lens).cumsum(0) - 1
                h = h[last]
            h = rms_norm(h, self.ln_f, self.eps)
            logits = torch.cat([h @ part.T for part in self.lm_head], dim=-1)
            if comm is not None:
                logits = comm.all_gather(logits)
            logits = logits[:, : self.vocab_size]
        elif comm is not None:
            comm.send_activations(h)
        if comm is not None:
            return comm.finish_step(logits, (rows, self.vocab_size))
        return logits

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over the tensor-parallel ranks: the model holds every
        rank and has summed them already, or a rank process all-reduces its part."""
        return x if self.comm is None else self.comm.all_reduce(x)

    def _gqa(self, x, layer: Layer, cos, sin, plan: _AttentionPlan,
             cache: KVCache | None) -> torch.Tensor:
        """Grouped-query attention of every tp rank, summed (the all-reduce)."""
        qkv = [self._qkv(x, w) for w in layer.ranks]
        if self.ckpt.facts.qk_norm_projection:
            qkv = projection_qk_norm(qkv, [w.q_norm for w in layer.ranks],
                                     [w.k_norm for w in layer.ranks], self.num_heads,
                                     self.num_kv_heads, self.head_size, self.eps,
                                     tp=self.mapping.tp, reduce=self._reduce)
        attn = torch.zeros_like(x)
        for r, w in enumerate(layer.ranks):
            attn += self._attention(qkv[r], w, layer.index, r, cos, sin, plan, cache)
        attn = self._reduce(attn)
        return attn if layer.dense_bias is None else attn + layer.dense_bias

    def _qkv(self, x, w: RankLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rank's q, k and v projections ``[T, heads_r * head_size]``."""
        hd = self.head_size
        if w.qkv is None:
            raise CheckpointError("attention weights missing (an MLA layer without MLA config)")
        qkv = w.quant("qkv", x) @ w.qkv.T
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        q, k, v = qkv.split([w.heads * hd, w.kv_heads * hd, w.kv_heads * hd], dim=-1)
        return q, k, v

    def _attention(self, qkv, w: RankLayer, layer: int, rank: int, cos, sin,
                   plan: _AttentionPlan, cache: KVCache | None) -> torch.Tensor:
        hd = self.head_size
        if w.dense is None:
            raise CheckpointError("attention weights missing (an MLA layer without MLA config)")
        q = qkv[0].reshape(-1, w.heads, hd)
        k = qkv[1].reshape(-1, w.kv_heads, hd)
        v = qkv[2].reshape(-1, w.kv_heads, hd)
        if w.q_norm is not None and w.k_norm is not None \
                and not self.ckpt.facts.qk_norm_projection:  # per head (Qwen3)
            q = rms_norm(q, w.q_norm, self.eps)
            k = rms_norm(k, w.k_norm, self.eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if w.kv is not None:  # the cache holds quantized keys and values
            k, v = w.kv(k), w.kv(v)
        out = torch.empty_like(q)
        if plan.decode is not None:
            idx = plan.decode[0]
            out[idx] = self._decode_attention(q[idx], k[idx], v[idx], layer, rank, cache,
                                              plan.decode[1:], w)
        for start, n, past, slot in plan.prefill:
            out[start:start + n] = self._prefill_attention(
                q[start:start + n], k[start:start + n], v[start:start + n], layer, rank,
                past, slot, cache, w)
        return w.quant("dense", out.reshape(-1, w.heads * hd)) @ w.dense.T

    def _prefill_attention(self, q, k, v, layer, rank, past, slot, cache, w: RankLayer):
        """One sequence's new tokens (a prompt, or a chunk of one)."""
        n = q.shape[0]
        qs, ks, vs = (t.transpose(0, 1) for t in (q, k, v))
        if cache is not None:
            kc, vc = cache.k[layer][rank], cache.v[layer][rank]
            kc[slot, :, past:past + n] = ks
            vc[slot, :, past:past + n] = vs
            ks, vs = kc[slot, :, :past + n], vc[slot, :, :past + n]
        q_pos = past + torch.arange(n)
        mask = window_mask(torch.arange(past + n)[None, :] <= q_pos[:, None], q_pos, w.window)
        return attend(qs, ks, vs, mask, w.sinks).transpose(0, 1)

    def _decode_attention(self, q, k, v, layer, rank, cache, decode, w: RankLayer):
        kc, vc = cache.k[layer][rank], cache.v[layer][rank]
        slots, past, length, mask = decode
        kc[slots, :, past] = k
        vc[slots, :, past] = v
        keys, values = kc[slots, :, :length], vc[slots, :, :length]
        mask = window_mask(mask, past[:, None, None], w.window)
        return attend(q[:, :, None, :], keys, values, mask, w.sinks)[:, :, 0, :]

    def _moe(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        if layer.router is None:  # a dense layer: its MLP is held as an ungated shared expert
            out = torch.zeros_like(x)
            for w in layer.ranks:
                shared_expert(x, layer, w, out)
            return out
        logits = x.float() @ layer.router.T
        # torch.ops.moepipe.route: ids, weights and the per-expert counts behind the
        # moepipe_expert_tokens_total metrics
        ids, weights, counts = self.route(logits, self.ckpt.routing,
                                          router_bias=layer.router_bias,
                                          correction_bias=layer.correction_bias)
        ids = ids.long()
        self.expert_tokens[layer.index] += counts
        w0 = layer.ranks[0]
        if x.shape[0] * self.num_experts * (w0.fc[0].numel() + w0.proj[0].numel()) \
                <= DENSE_LIMIT:
            return experts_dense(x, layer, ids, weights, self.num_experts, self.act)
        return experts_sparse(x, layer, ids, weights, counts, self.act)
