"""The fused routing kernel (OpenAI Triton): router logits -> expert ids, weights, counts.

One kernel for every routing mode of ``moepipe.runtime.routing.RoutingSpec``, specialised by
compile-time constants, so each family's kernel carries only its own arithmetic. It follows
``moepipe.runtime.routing.route`` exactly (same selection key, same tie rule: lower expert id
first; ids in descending key order) and is tested against it under ``TRITON_INTERPRET=1``.

Layout: the experts of a token are held as a [groups, experts per group] tile (one group when
routing is not group-limited), ``BLOCK_T`` tokens at a time; a fixed grid of programs walks
the tokens with a stride, so the per-expert counts are per-program partial sums
``counts_partial[program, expert]`` written with plain stores - no atomics, no zeroed output,
no global scratch (the TensorRT binding cannot zero or scratch). ``counts = partial.sum(0)``.

Kernel arguments, in the order TensorRT's ahead-of-time plugin passes them (inputs, scalars,
outputs): ``logits f32 [T, E], router_bias f32 [E], correction_bias f32 [E], T i32,
ids i32 [T, k], weights f32 [T, k], counts_partial i32 [P, E]``. Bias pointers are always
passed; the constants say whether they are read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moepipe.plugins.launch import LaunchConfig, constexprs, launch_config

KERNEL_NAME = "moe_route"
__all__ = ["KERNEL_NAME", "LaunchConfig", "constexprs", "launch_config", "moe_route",
           "route_triton"]


@triton.jit
def moe_route(logits_ptr, router_bias_ptr, correction_bias_ptr, T,
              ids_ptr, weights_ptr, counts_ptr,
              E: tl.constexpr, K: tl.constexpr, N_GROUP: tl.constexpr,
              GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
              SIGMOID: tl.constexpr, TOPK_FIRST: tl.constexpr, RENORM: tl.constexpr,
              GROUP_TOP2: tl.constexpr, SCORED_KEY: tl.constexpr, SCALE: tl.constexpr,
              HAS_ROUTER_BIAS: tl.constexpr, HAS_CORRECTION_BIAS: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
              BLOCK_K: tl.constexpr):
    NEG: tl.constexpr = float("-inf")
    g = tl.arange(0, BLOCK_G)
    s = tl.arange(0, BLOCK_S)
    kk = tl.arange(0, BLOCK_K)
    col = g[:, None] * GROUP_SIZE + s[None, :]  # expert id of each tile slot
    cvalid = (g[:, None] < N_GROUP) & (s[None, :] < GROUP_SIZE)
    kvalid = kk[None, :] < K
    if HAS_ROUTER_BIAS:
        rbias = tl.load(router_bias_ptr + col, mask=cvalid, other=0.0)
    if HAS_CORRECTION_BIAS:
        cbias = tl.load(correction_bias_ptr + col, mask=cvalid, other=0.0)
    counts = tl.zeros([BLOCK_G, BLOCK_S], dtype=tl.int32)
    for start in range(tl.program_id(0) * BLOCK_T, T, tl.num_programs(0) * BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        rvalid = rows < T
        valid = rvalid[:, None, None] & cvalid[None, :, :]
        z = tl.load(logits_ptr + rows[:, None, None] * E + col[None, :, :], mask=valid,
                    other=NEG)
        if HAS_ROUTER_BIAS:
            z = tl.where(valid, z + rbias[None, :, :], NEG)
        zmax = tl.where(rvalid, tl.max(tl.max(z, axis=2), axis=1), 0.0)
        if not SIGMOID:
            den = tl.sum(tl.sum(tl.exp(z - zmax[:, None, None]), axis=2), axis=1)
            den = tl.where(rvalid, den, 1.0)
        if SCORED_KEY:
            if SIGMOID:
                key = 1.0 / (1.0 + tl.exp(-z))
            else:
                key = tl.exp(z - zmax[:, None, None]) / den[:, None, None]
            if HAS_CORRECTION_BIAS:
                key = key + cbias[None, :, :]
            key = tl.where(valid, key, NEG)
        else:
            key = z
        if N_GROUP > 1:
            # group score: best key of the group, or the sum of its two best
            gbest = tl.max(key, axis=2)
            if GROUP_TOP2:
                first = tl.min(tl.where(key == gbest[:, :, None], s[None, None, :], BLOCK_S),
                               axis=2)
                rest = tl.where((s[None, None, :] == first[:, :, None]) | ~valid, NEG, key)
                gkey = gbest + tl.max(rest, axis=2)
            else:
                gkey = gbest
            gvalid = g[None, :] < N_GROUP
            keep = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                cand = gvalid & ~keep
                gk = tl.where(cand, gkey, NEG)
                gm = tl.max(gk, axis=1)
                gi = tl.min(tl.where(cand & (gk == gm[:, None]), g[None, :], BLOCK_G), axis=1)
                keep = keep | (g[None, :] == gi[:, None])
            key = tl.where(keep[:, :, None], key, NEG)
        out_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
        out_z = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        taken = tl.zeros([BLOCK_T, BLOCK_G, BLOCK_S], dtype=tl.int1)
        for j in tl.static_range(K):
            cand = valid & ~taken
            kj = tl.where(cand, key, NEG)
            m = tl.max(tl.max(kj, axis=2), axis=1)
            hit = cand & (kj == m[:, None, None])
            idx = tl.min(tl.min(tl.where(hit, col[None, :, :], E), axis=2), axis=1)
            chosen = valid & (col[None, :, :] == idx[:, None, None])
            taken = taken | chosen
            zj = tl.sum(tl.sum(tl.where(chosen, z, 0.0), axis=2), axis=1)
            out_ids = tl.where(kk[None, :] == j, idx[:, None], out_ids)
            out_z = tl.where(kk[None, :] == j, zj[:, None], out_z)
        if TOPK_FIRST:
            top = tl.max(tl.where(kvalid, out_z, NEG), axis=1)
            e = tl.where(kvalid, tl.exp(out_z - top[:, None]), 0.0)
            w = e / tl.sum(e, axis=1)[:, None]
        elif SIGMOID:
            w = 1.0 / (1.0 + tl.exp(-out_z))
        else:
            w = tl.exp(out_z - zmax[:, None]) / den[:, None]
        w = tl.where(kvalid, w, 0.0)
        if RENORM:
            w = w / tl.sum(w, axis=1)[:, None]
        if SCALE != 1.0:
            w = w * SCALE
        omask = rvalid[:, None] & kvalid
        tl.store(ids_ptr + rows[:, None] * K + kk[None, :], out_ids, mask=omask)
        tl.store(weights_ptr + rows[:, None] * K + kk[None, :], w, mask=omask)
        counts += tl.sum(taken.to(tl.int32), axis=0)
    tl.store(counts_ptr + tl.program_id(0) * E + col, counts, mask=cvalid)


def route_triton(logits, spec, router_bias=None, correction_bias=None,
                 config: LaunchConfig | None = None):
    """Run the kernel: ``logits`` f32 [T, E] -> (ids int32 [T, k], weights f32 [T, k],
    counts int32 [E]). On CPU tensors this needs ``TRITON_INTERPRET=1`` set before Triton
    was imported."""
    import torch

    config = config or launch_config(spec)
    logits = logits.float().contiguous()
    tokens = logits.shape[0]
    dev = logits.device
    ids = torch.empty(tokens, spec.top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(tokens, spec.top_k, dtype=torch.float32, device=dev)
    programs = max(1, min(config.num_programs, triton.cdiv(tokens, config.block_t)))
    partial = torch.empty(programs, spec.num_experts, dtype=torch.int32, device=dev)
    rbias = logits if router_bias is None else router_bias.float().contiguous()
    cbias = logits if correction_bias is None else correction_bias.float().contiguous()
    if tokens:
        moe_route[(programs,)](logits, rbias, cbias, tokens, ids, weights, partial,
                               num_warps=config.num_warps, **constexprs(spec, config))
    else:
        partial.zero_()
    return ids, weights, partial.sum(0, dtype=torch.int32)
