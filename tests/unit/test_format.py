"""The converter writes TensorRT-LLM's checkpoint format exactly: names, shapes, dtypes, fused
orders and the way tp / pp / moe_tp / moe_ep split tensors (re-derived here independently, the
way TensorRT-LLM's own convert.py does it on full tensors)."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from moepipe.conversion.write import convert


def _hf(folder):
    return load_file(folder / "model.safetensors")


def _split(t, parts, index, dim):
    return t.chunk(parts, dim=dim)[index] if parts > 1 else t


def _expected_rank(hf, family, rank, tp, pp, moe_tp, moe_ep, layers=4, experts=8, heads=4,
                   kv=2, hd=16, vocab=None):
    """TensorRT-LLM's rules, straight from tensorrt_llm/models/{llama,qwen}/convert.py."""
    tp_rank, pp_rank = rank % tp, rank // tp
    ep_rank, mtp_rank = tp_rank % moe_ep, tp_rank // moe_ep
    per_stage = layers // pp
    out = {}
    moe = "block_sparse_moe" if family == "tiny-mixtral" else "mlp"
    names = ({"gate": "w1", "up": "w3", "down": "w2"} if family == "tiny-mixtral" else
             {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    for local in range(per_stage):
        layer = pp_rank * per_stage + local
        p, t = f"model.layers.{layer}.", f"transformer.layers.{local}."
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        if kv < tp:  # dup_kv_weight
            reps = tp // kv
            k = k.reshape(kv, hd, -1)[:, None].expand(kv, reps, hd, k.shape[-1]).reshape(-1, k.shape[-1])
            v = v.reshape(kv, hd, -1)[:, None].expand(kv, reps, hd, v.shape[-1]).reshape(-1, v.shape[-1])
        out[t + "attention.qkv.weight"] = torch.cat([_split(x, tp, tp_rank, 0) for x in (q, k, v)])
        out[t + "attention.dense.weight"] = _split(hf[p + "self_attn.o_proj.weight"], tp, tp_rank, 1)
        out[t + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[t + "post_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        rng = range(ep_rank * experts // moe_ep, (ep_rank + 1) * experts // moe_ep)
        stack = {n: torch.stack([hf[p + f"{moe}.experts.{e}.{hfn}.weight"] for e in rng])
                 for n, hfn in names.items()}
        w3 = _split(stack["up"], moe_tp, mtp_rank, 1)
        w1 = _split(stack["gate"], moe_tp, mtp_rank, 1)
        out[t + "mlp.fc.weight"] = torch.cat([w3, w1], dim=-2)
        out[t + "mlp.proj.weight"] = _split(stack["down"], moe_tp, mtp_rank, 2)
        out[t + "mlp.router.weight"] = hf[p + f"{moe}.gate.weight"].float()
        if family == "tiny-qwen2-moe":
            bq, bk, bv = (hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv")
            if kv < tp:
                bk = bk.reshape(kv, hd)[:, None].expand(kv, tp // kv, hd).reshape(-1)
                bv = bv.reshape(kv, hd)[:, None].expand(kv, tp // kv, hd).reshape(-1)
            out[t + "attention.qkv.bias"] = torch.cat([_split(x, tp, tp_rank, 0) for x in (bq, bk, bv)])
            s = p + "mlp.shared_expert."
            out[t + "mlp.shared_expert.fc.weight"] = torch.cat(
                [_split(hf[s + "up_proj.weight"], tp, tp_rank, 0),
                 _split(hf[s + "gate_proj.weight"], tp, tp_rank, 0)], dim=-2)
            out[t + "mlp.shared_expert.proj.weight"] = _split(hf[s + "down_proj.weight"], tp, tp_rank, 1)
            out[t + "mlp.shared_expert_gate.weight"] = hf[p + "mlp.shared_expert_gate.weight"]
        if family == "tiny-qwen3-moe":
            out[t + "attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
            out[t + "attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
    if pp_rank == 0:
        out["transformer.vocab_embedding.weight"] = hf["model.embed_tokens.weight"]
    if pp_rank == pp - 1:
        out["transformer.ln_f.weight"] = hf["model.norm.weight"]
        lm = hf["lm_head.weight"]
        pad = -lm.shape[0] % tp
        lm = torch.cat([lm, torch.zeros(pad, lm.shape[1])]) if pad else lm
        out["lm_head.weight"] = _split(lm, tp, tp_rank, 0)
    return out


CASES = [("tiny-mixtral", (4, 1, 2, 2)), ("tiny-mixtral", (2, 2, 1, 2)),
         ("tiny-qwen2-moe", (4, 1, 2, 2)), ("tiny-qwen2-moe", (4, 1, 1, 4)),
         ("tiny-qwen3-moe", (4, 1, 1, 4)), ("tiny-qwen3-moe", (2, 2, 2, 1))]


@pytest.mark.parametrize("family,mapping", CASES)
def test_rank_tensors_follow_trtllm_rules(family, mapping, examples, tmp_path):
    tp, pp, moe_tp, moe_ep = mapping
    out = tmp_path / "ckpt"
    convert(examples[family], out, tp=tp, pp=pp, moe_tp=moe_tp, moe_ep=moe_ep)
    hf = _hf(examples[family])
    for rank in range(tp * pp):
        got = load_file(out / f"rank{rank}.safetensors")
        want = _expected_rank(hf, family, rank, tp, pp, moe_tp, moe_ep)
        assert sorted(got) == sorted(want), f"rank {rank} tensor names"
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype, name
            assert got[name].shape == tensor.shape, name
            assert torch.equal(got[name], tensor), name
        assert got[next(n for n in got if n.endswith("mlp.router.weight"))].dtype == torch.float32


def test_config_json_fields(examples, tmp_path):
    out = tmp_path / "ckpt"
    convert(examples["tiny-qwen2-moe"], out, tp=4, moe_ep=2, dtype="bfloat16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == "Qwen2MoeForCausalLM"
    assert cfg["dtype"] == "bfloat16"
    assert cfg["qwen_type"] == "qwen2_moe"
    assert cfg["moe_intermediate_size"] == 32
    assert cfg["moe_shared_expert_intermediate_size"] == 64
    assert cfg["hidden_act"] == "swiglu"
    assert cfg["position_embedding_type"] == "rope_gpt_neox"
    assert cfg["moe"]["num_experts"] == 8 and cfg["moe"]["top_k"] == 2
    assert cfg["moe"]["normalization_mode"] == 0  # norm_topk_prob false
    assert cfg["mapping"] == {"world_size": 4, "gpus_per_node": 8, "cp_size": 1, "tp_size": 4,
                              "pp_size": 1, "moe_tp_size": 2, "moe_cluster_size": 1,
                              "moe_ep_size": 2, "attn_tp_size": 4, "attn_cp_size": 1,
                              "cp_config": {}, "enable_attention_dp": False,
                              "enable_lm_head_tp_in_adp": False}
    assert set(cfg["quantization"]) == {"quant_algo", "kv_cache_quant_algo", "group_size",
                                        "smoothquant_val", "clamp_val", "use_meta_recipe",
                                        "has_zero_point", "pre_quant_scale", "exclude_modules"}

    rank = load_file(out / "rank0.safetensors")
    assert rank["transformer.layers.0.mlp.fc.weight"].dtype == torch.bfloat16
    assert rank["transformer.layers.0.mlp.router.weight"].dtype == torch.float32
    mix = tmp_path / "mix"
    convert(examples["tiny-mixtral"], mix)
    cfg = json.loads((mix / "config.json").read_text())
    assert cfg["moe"]["normalization_mode"] == 1 and cfg["rotary_base"] == 1e6
    assert cfg["intermediate_size"] == 32


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _b3(path):
    import blake3

    return blake3.blake3(path.read_bytes()).hexdigest()


def test_conversion_is_deterministic_and_has_manifest(examples, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    convert(examples["tiny-mixtral"], a, tp=2, moe_ep=2, workers=2)
    convert(examples["tiny-mixtral"], b, tp=2, moe_ep=2, workers=1)
    assert _digests(a) == _digests(b)
    manifest = json.loads((a / "moepipe-manifest.json").read_text())
    assert manifest["mapping"] == {"tp": 2, "pp": 1, "moe_tp": 1, "moe_ep": 2, "world_size": 2}
    # the manifest names its digests' algorithm: BLAKE3 of the files' bytes
    assert manifest["source"]["blake3"]["model.safetensors"] == _b3(
        examples["tiny-mixtral"] / "model.safetensors")
    for name, digest in manifest["output"]["blake3"].items():
        assert _b3(a / name) == digest
    assert sorted(p.name for p in a.iterdir()) == [
        "config.json", "moepipe-manifest.json", "rank0.safetensors", "rank1.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# TensorRT-LLM 1.2 (1.2.0rc2, commit b35ac1b6) rebuilds both blocks with cls(**block), so a key
# outside these keyword sets fails trtllm-build with a TypeError:
# tensorrt_llm/mapping.py - MappingBase.__init__ (and what its to_dict() writes, less `rank`);
# tensorrt_llm/models/modeling_utils.py - the QuantConfig dataclass fields.
TRTLLM_1_2_MAPPING_TO_DICT = {"world_size", "rank", "gpus_per_node", "cp_size", "tp_size",
                              "pp_size", "moe_tp_size", "moe_cluster_size", "moe_ep_size",
                              "attn_tp_size", "attn_cp_size", "cp_config", "enable_attention_dp",
                              "enable_lm_head_tp_in_adp"}
TRTLLM_1_2_QUANT_CONFIG = {"quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val",
                           "clamp_val", "use_meta_recipe", "has_zero_point", "pre_quant_scale",
                           "exclude_modules", "mamba_ssm_cache_dtype"}


def test_mapping_and_quantization_blocks_are_what_trtllm_1_2_constructs(examples, tmp_path):
    out = tmp_path / "ckpt"
    convert(examples["tiny-mixtral"], out, tp=2, moe_ep=2)
    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg["mapping"]) == TRTLLM_1_2_MAPPING_TO_DICT - {"rank"}
    assert set(cfg["quantization"]) <= TRTLLM_1_2_QUANT_CONFIG
    from moepipe.checkpoints.modelopt import QuantInfo
    from moepipe.trtllm.checkpoint_config import quantization_block
    for algo in ("FP8", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL"):
        block = quantization_block(QuantInfo(algo, "FP8", 128, ()))
        assert set(block) <= TRTLLM_1_2_QUANT_CONFIG, algo
