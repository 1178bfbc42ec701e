"""The reference runtime: a TensorRT-LLM checkpoint run on CPU with torch, rank by rank.

Every tensor-parallel rank computes with its own shard and the partial results are summed, as
TensorRT-LLM's all-reduce does: attention heads per rank, row-parallel dense output, experts of
the rank's EP group on its slice of the expert FFN, shared expert split over tp, vocab-parallel
``lm_head`` gathered. Pipeline stages run one after the other. Weights are the checkpoint's own
(cast to float32 for compute), so parity with Hugging Face proves the converter and the config.

The batch interface is *packed*: tokens of several sequences concatenated, each sequence with its
cache slot and the number of tokens already cached - ragged prefill and batched decode share one
``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moepipe.errors import CheckpointError
from moepipe.mapping import stage_layers
from moepipe.runtime import mla
from moepipe.runtime.activations import expert_activation
from moepipe.runtime.attention_ext import attend, projection_qk_norm, window_mask
from moepipe.runtime.checkpoint import TrtllmCheckpoint
from moepipe.runtime.moe import experts_dense, experts_sparse, shared_expert
from moepipe.runtime.routing import RouteFn, route_op
from moepipe.runtime.weights import Layer, RankLayer, WeightLoader

# MoE strategy by work size (multiply-adds of a layer's experts on this batch): all experts
# densely, zero-weighting the unselected, while that is cheap (tiny models, decode steps);
# else one loop over the selected experts.
DENSE_LIMIT = 1 << 24


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
    """Per-slot key/value cache, one tensor per (layer, tp rank)."""

    def __init__(self, model: ReferenceModel, num_slots: int, max_len: int):
        self.num_slots, self.max_len = num_slots, max_len
        self.k: list[list[torch.Tensor]] = []
        self.v: list[list[torch.Tensor]] = []
        for layer in model.layers:
            if model.mla is not None:  # one latent per token, shared by the tp ranks
                self.k.append([torch.zeros(num_slots, 1, max_len, model.mla.cache_width)])
                self.v.append([])
                continue
            shape = [(num_slots, r.kv_heads, max_len, model.head_size) for r in layer.ranks]
            self.k.append([torch.zeros(s) for s in shape])
            self.v.append([torch.zeros(s) for s in shape])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ReferenceModel:
    """Forward passes over a loaded :class:`TrtllmCheckpoint`.

    ``previous``: the version of the same model this one replaces (a live weight update):
    every float32 tensor made from the same checkpoint tensor objects is shared with it, and
    so are the expert counters."""

    def __init__(self, ckpt: TrtllmCheckpoint, router: RouteFn = route_op,
                 previous: ReferenceModel | None = None):
        self.ckpt = ckpt
        self.route = router
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
        self.layers: list[Layer] = []
        for stage in range(m.pp):
            stage_ranks = [stage * m.tp + t for t in range(m.tp)]
            for local, index in enumerate(stage_layers(ckpt.num_layers, m.pp, stage)):
                self.layers.append(load.layer(index, f"transformer.layers.{local}.", stage_ranks))
        first, last = 0, (m.pp - 1) * m.tp
        self.embedding = load.get(first, "transformer.vocab_embedding.weight")
        self.ln_f = load.get(last, "transformer.ln_f.weight")
        self.lm_head = [load.get(last + t, "lm_head.weight") for t in range(m.tp)]
        load.finish()
        self.loader: WeightLoader = load  # what the next version reuses
        self.expert_tokens: torch.Tensor = (
            previous.expert_tokens if previous is not None
            else torch.zeros(ckpt.num_layers, self.num_experts, dtype=torch.long))

    # -- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: Batch, cache: KVCache | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Logits of the last token of each sequence ``[num_seqs, vocab]`` (or of every token
        with ``all_logits``). With a cache, new keys/values are stored in the sequences' slots."""
        positions = torch.cat([torch.arange(p, p + n) for p, n in
                               zip(batch.past_lens, batch.seq_lens, strict=True)])
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        f = self.rope_factor
        cos, sin = f * emb.cos()[:, None, :], f * emb.sin()[:, None, :]
        h = self.embedding[batch.tokens]
        plan = _AttentionPlan.of(batch, cache)
        for layer in self.layers:
            x = rms_norm(h, layer.input_norm, self.eps)
            if layer.mla is not None and self.mla is not None:
                attn = mla.attention(x, layer.mla, self.mla, cos, sin, plan,
                                     cache.k[layer.index][0] if cache else None,
                                     self.mla_absorbed)
            else:
                attn = self._gqa(x, layer, cos, sin, plan, cache)
            h = h + attn
            x = rms_norm(h, layer.post_norm, self.eps)
            h = h + self._moe(x, layer)
        if not all_logits:
            last = torch.tensor(batch.seq_lens).cumsum(0) - 1
            h = h[last]
        h = rms_norm(h, self.ln_f, self.eps)
        logits = torch.cat([h @ part.T for part in self.lm_head], dim=-1)
        return logits[:, : self.vocab_size]

    def _gqa(self, x, layer: Layer, cos, sin, plan: _AttentionPlan,
             cache: KVCache | None) -> torch.Tensor:
        """Grouped-query attention of every tp rank, summed (the all-reduce)."""
        qkv = [self._qkv(x, w) for w in layer.ranks]
        if self.ckpt.facts.qk_norm_projection:
            qkv = projection_qk_norm(qkv, [w.q_norm for w in layer.ranks],
                                     [w.k_norm for w in layer.ranks], self.num_heads,
                                     self.num_kv_heads, self.head_size, self.eps)
        attn = torch.zeros_like(x)
        for r, w in enumerate(layer.ranks):
            attn += self._attention(qkv[r], w, layer.index, r, cos, sin, plan, cache)
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
