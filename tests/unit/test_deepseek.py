"""DeepSeek-V2 / V3: the converter writes TensorRT-LLM 1.2's DeepseekV2ForCausalLM checkpoint
(re-derived here on full tensors the way upstream's converter does it), and the reference
runtime's MLA formulations and routing agree.

Upstream (NVIDIA/TensorRT-LLM; read at commits 130232d9 and 65b31db1 of convert.py, which agree
on every name below; the 1.2.1 tag itself could not be fetched here):
- tensorrt_llm/models/deepseek_v2/convert.py ``load_weights_from_hf_model``: fused_a, q_b_proj,
  kv_b_proj ([k_nope rows; v rows] of the rank's heads), fused_q_proj (einsum 'hdq,hdk->hkq' then
  the rope rows), dense layers as GatedMLP (fc <- gate_proj, gate <- up_proj), experts
  ``fc = cat([up, gate], -2)``, router float32, ``mlp.e_score_correction_bias`` for noaux_tc,
  shared experts ``mlp.shared_expert.{fc,proj}``;
- tensorrt_llm/models/deepseek_v2/config.py ``DeepSeekV2Config.from_hugging_face``: config keys
  (num_key_value_heads 1, head_size kv_lora_rank + qk_rope_head_dim, moe_inter_size, the MLA
  dims, topk_method, first_k_dense_replace, moe_layer_freq, coring_func, fp8_format) and the moe
  block (shared_expert_intermediate_size = n_shared_experts * moe_intermediate_size,
  device_limited_n_group / topk_group / routed_scaling_factor);
- tensorrt_llm/models/deepseek_v2/model.py: SharedMoE with use_shared_gate=False.
"""

import json
from pathlib import Path

import pytest
import torch
from meta_reader import MetaReader
from safetensors.torch import load_file

from moepipe.conversion.write import convert
from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.model import Batch, ReferenceModel

PROMPT = [54, 260, 402, 305, 77, 445, 510, 271, 494, 12, 99, 300]
DIMS = dict(heads=4, nope=16, rope=8, v=16, kv_lora=32, dense=1, experts=8)


def _split(t, parts, index, dim):
    return t.chunk(parts, dim=dim)[index] if parts > 1 else t


def _expected_rank(hf, cfg, rank, tp, pp, moe_tp, moe_ep):
    """upstream convert.py, on full tensors."""
    d = DIMS
    tp_rank, pp_rank = rank % tp, rank // tp
    ep_rank, mtp_rank = tp_rank % moe_ep, tp_rank // moe_ep
    layers = cfg["num_hidden_layers"]
    per = -(-layers // pp)
    stage = range(pp_rank * per, min(layers, (pp_rank + 1) * per))
    q_lora = cfg["q_lora_rank"]
    out = {}
    for local, layer in enumerate(stage):
        p, t = f"model.layers.{layer}.", f"transformer.layers.{local}."
        a = p + "self_attn."
        kv_a = hf[a + "kv_a_proj_with_mqa.weight"]
        if q_lora:
            fused_a = torch.cat([hf[a + "q_a_proj.weight"], kv_a])
            q_b = hf[a + "q_b_proj.weight"]
            out[t + "attention.q_a_layernorm.weight"] = hf[a + "q_a_layernorm.weight"]
        else:
            fused_a, q_b = kv_a, hf[a + "q_proj.weight"]
        q_b = _split(q_b.unflatten(0, [d["heads"], d["nope"] + d["rope"]]), tp, tp_rank, 0)
        kv_b = _split(hf[a + "kv_b_proj.weight"].unflatten(0, [d["heads"], d["nope"] + d["v"]]),
                      tp, tp_rank, 0)
        q_nope, q_pe = q_b.split([d["nope"], d["rope"]], dim=1)
        k_nope, v = kv_b.split([d["nope"], d["v"]], dim=1)
        out[t + "attention.fused_a.weight"] = fused_a
        out[t + "attention.kv_a_layernorm.weight"] = hf[a + "kv_a_layernorm.weight"]
        out[t + "attention.q_b_proj"] = q_b.reshape(-1, q_b.shape[-1])
        out[t + "attention.kv_b_proj"] = torch.cat([k_nope.reshape(-1, d["kv_lora"]),
                                                    v.reshape(-1, d["kv_lora"])])
        out[t + "attention.fused_q_proj"] = torch.cat(
            [torch.einsum("hdq,hdk->hkq", q_nope, k_nope), q_pe], dim=1).flatten(0, 1)
        out[t + "attention.dense.weight"] = _split(hf[a + "o_proj.weight"], tp, tp_rank, 1)
        out[t + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[t + "post_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        m = p + "mlp."
        if layer < d["dense"]:
            out[t + "mlp.gate.weight"] = _split(hf[m + "up_proj.weight"], tp, tp_rank, 0)
            out[t + "mlp.fc.weight"] = _split(hf[m + "gate_proj.weight"], tp, tp_rank, 0)
            out[t + "mlp.proj.weight"] = _split(hf[m + "down_proj.weight"], tp, tp_rank, 1)
            continue
        rng = range(ep_rank * d["experts"] // moe_ep, (ep_rank + 1) * d["experts"] // moe_ep)
        stack = {n: torch.stack([hf[m + f"experts.{e}.{n}_proj.weight"] for e in rng])
                 for n in ("gate", "up", "down")}
        out[t + "mlp.fc.weight"] = torch.cat([_split(stack["up"], moe_tp, mtp_rank, 1),
                                              _split(stack["gate"], moe_tp, mtp_rank, 1)], dim=-2)
        out[t + "mlp.proj.weight"] = _split(stack["down"], moe_tp, mtp_rank, 2)
        out[t + "mlp.router.weight"] = hf[m + "gate.weight"].float()
        if m + "gate.e_score_correction_bias" in hf:
            out[t + "mlp.e_score_correction_bias"] = hf[m + "gate.e_score_correction_bias"].float()
        s = m + "shared_experts."
        out[t + "mlp.shared_expert.fc.weight"] = torch.cat(
            [_split(hf[s + "up_proj.weight"], tp, tp_rank, 0),
             _split(hf[s + "gate_proj.weight"], tp, tp_rank, 0)], dim=-2)
        out[t + "mlp.shared_expert.proj.weight"] = _split(hf[s + "down_proj.weight"], tp,
                                                          tp_rank, 1)
    if pp_rank == 0:
        out["transformer.vocab_embedding.weight"] = hf["model.embed_tokens.weight"]
    if pp_rank == pp - 1:
        out["transformer.ln_f.weight"] = hf["model.norm.weight"]
        out["lm_head.weight"] = _split(hf["lm_head.weight"], tp, tp_rank, 0)
    return out


CASES = [("tiny-deepseek-v2", (4, 1, 2, 2)), ("tiny-deepseek-v2", (2, 2, 1, 2)),
         ("tiny-deepseek-v3", (4, 1, 1, 4)), ("tiny-deepseek-v3", (2, 2, 2, 1))]


@pytest.mark.parametrize("family,mapping", CASES)
def test_rank_tensors_follow_trtllm_deepseek_rules(family, mapping, examples, tmp_path):
    tp, pp, moe_tp, moe_ep = mapping
    out = tmp_path / "ckpt"
    convert(examples[family], out, tp=tp, pp=pp, moe_tp=moe_tp, moe_ep=moe_ep)
    hf = load_file(examples[family] / "model.safetensors")
    cfg = json.loads((examples[family] / "config.json").read_text())
    for rank in range(tp * pp):
        got = load_file(out / f"rank{rank}.safetensors")
        want = _expected_rank(hf, cfg, rank, tp, pp, moe_tp, moe_ep)
        assert sorted(got) == sorted(want), f"rank {rank} tensor names"
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype, name
            assert got[name].shape == tensor.shape, name
            if name.endswith("fused_q_proj"):  # a product: summation order may differ
                torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(got[name], tensor), name


def test_config_json_is_trtllm_deepseek_v2_config(examples, tmp_path):
    convert(examples["tiny-deepseek-v2"], tmp_path / "v2", tp=2, moe_ep=2)
    cfg = json.loads((tmp_path / "v2" / "config.json").read_text())
    assert cfg["architecture"] == "DeepseekV2ForCausalLM"
    assert cfg["num_key_value_heads"] == 1 and cfg["head_size"] == 32 + 8
    assert (cfg["kv_lora_rank"], cfg["q_lora_rank"], cfg["qk_nope_head_dim"],
            cfg["qk_rope_head_dim"], cfg["v_head_dim"]) == (32, None, 16, 8, 16)
    assert cfg["intermediate_size"] == 96 and cfg["moe_inter_size"] == 32
    assert cfg["topk_method"] == "group_limited_greedy" and cfg["coring_func"] == "softmax"
    assert cfg["first_k_dense_replace"] == 1 and cfg["moe_layer_freq"] == 1
    assert cfg["fp8_format"] is False and cfg["rotary_base"] == 10000.0
    # the yarn keys upstream's config.py copies from hf_config.rope_scaling, plus type
    assert cfg["rotary_scaling"] == {"beta_fast": 32, "beta_slow": 1, "factor": 4.0,
                                     "mscale": 0.707, "mscale_all_dim": 0.707,
                                     "original_max_position_embeddings": 512, "type": "yarn"}
    assert cfg["moe"] == {"num_experts": 8, "shared_expert_intermediate_size": 64, "top_k": 2,
                          "normalization_mode": 3, "sparse_mixer_epsilon": 0.01, "tp_mode": 0,
                          "device_limited_n_group": 4, "device_limited_topk_group": 2,
                          "device_limited_routed_scaling_factor": 2.0}
    assert "moepipe_routing" not in cfg  # the engine's DEVICE_LIMITED routes V2 exactly

    convert(examples["tiny-deepseek-v3"], tmp_path / "v3")
    cfg = json.loads((tmp_path / "v3" / "config.json").read_text())
    assert cfg["architecture"] == "DeepseekV3ForCausalLM" and cfg["q_lora_rank"] == 48
    assert cfg["topk_method"] == "noaux_tc" and cfg["coring_func"] == "sigmoid"
    assert cfg["moe"]["shared_expert_intermediate_size"] == 32
    assert cfg["moepipe_routing"] == {
        "num_experts": 8, "top_k": 2, "score": "sigmoid", "topk_first": False,
        "renormalize": True, "n_group": 4, "topk_group": 2, "group_score": "top2_sum",
        "routed_scaling_factor": 2.5, "correction_bias": True, "router_bias": False}


@pytest.mark.parametrize("family", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_absorbed_and_plain_mla_agree(family, examples, tmp_path):
    """fused_q_proj (absorbed) and q_b_proj + kv_b_proj's k rows (plain) give the same logits:
    the three attention tensors are consistent with each other."""
    convert(examples[family], tmp_path / "ckpt", tp=2, moe_ep=2)
    model = ReferenceModel(load_checkpoint(tmp_path / "ckpt"))
    absorbed = model.forward(Batch.single(PROMPT), all_logits=True)
    model.mla_absorbed = False
    plain = model.forward(Batch.single(PROMPT), all_logits=True)
    torch.testing.assert_close(absorbed, plain, rtol=1e-5, atol=1e-5)


def test_correction_bias_steers_selection_only(examples, hf_models, tmp_path):
    """DeepSeek-V3's e_score_correction_bias changes which experts are chosen: with the bias
    zeroed the reference leaves Hugging Face's logits; with it, it matches them."""
    out = tmp_path / "ckpt"
    convert(examples["tiny-deepseek-v3"], out)
    with torch.no_grad():
        ref = hf_models["tiny-deepseek-v3"](torch.tensor([PROMPT])).logits[0]
    ckpt = load_checkpoint(out)
    good = ReferenceModel(ckpt).forward(Batch.single(PROMPT), all_logits=True)
    for name, tensor in ckpt.ranks[0].items():
        if name.endswith("e_score_correction_bias"):
            tensor.zero_()
    bad = ReferenceModel(ckpt).forward(Batch.single(PROMPT), all_logits=True)
    assert (good - ref).abs().max() <= 1e-4
    assert (bad - ref).abs().max() > 1e-2


@pytest.mark.parametrize("target,quantize,needle", [
    ("trtllm-engine", "none", "DeepseekV3ForCausalLM cannot be built for target trtllm-engine: "
                              "TensorRT-LLM 1.2 has no DeepSeek-V3 engine model"),
    ("cpu", "fp8", "moepipe does not quantize DeepseekV3ForCausalLM yet"),
])
def test_build_refuses_what_the_target_cannot_take(target, quantize, needle, tmp_path):
    """The convert stage's pre-flight refuses DeepSeek-V3 on the engine target (and DeepSeek
    quantization) with one line, before any stage runs."""
    from moepipe.config import parse_config
    from moepipe.errors import UnsupportedError
    from moepipe.stages.base import BuildContext
    from moepipe.stages.convert import STAGE

    data = {"model": {"example": "tiny-deepseek-v3"}, "target": target,
            "quantize": {"format": quantize}, "workdir": str(tmp_path)}
    cfg = parse_config(data, "moepipe.yaml", "").resolve_paths(tmp_path)
    with pytest.raises(UnsupportedError, match=needle):
        STAGE.preflight(BuildContext(cfg, lambda s: None))
    data["model"] = {"example": "tiny-deepseek-v2"}
    if quantize == "none":  # DeepSeek-V2 has an engine path
        STAGE.preflight(BuildContext(parse_config(data, "moepipe.yaml", "")
                                     .resolve_paths(tmp_path), lambda s: None))


def test_engine_problems_of_deepseek_v2_follow_upstream_model_py():
    """TensorRT-LLM 1.2 deepseek_v2/model.py: MoE when ``layer_idx > 0`` (one dense layer) and
    ``config.rotary_scaling['beta_fast']`` etc. read unconditionally."""
    import transformers

    from moepipe.arch import get_family
    from moepipe.examples import EXAMPLES

    family = get_family("DeepseekV2ForCausalLM")
    example = EXAMPLES["tiny-deepseek-v2"]

    def spec(**change):
        cfg = transformers.DeepseekV2Config(**{**example.config, **change}).to_dict()
        return family.spec({**cfg, "architectures": ["DeepseekV2ForCausalLM"]}, "test")

    assert family.engine_problem(spec()) is None
    assert "first_k_dense_replace 2" in family.engine_problem(spec(first_k_dense_replace=2))
    plain = {"rope_type": "default", "rope_theta": 10000.0}
    assert "yarn" in family.engine_problem(spec(rope_parameters=plain))
    assert "no DeepSeek-V3 engine" in get_family("DeepseekV3ForCausalLM").engine_problem(spec())


def test_engine_kv_estimate_counts_one_latent_per_token_and_layer(tmp_path):
    """MLA caches kv_lora_rank + qk_rope_head_dim elements per token and layer, one head
    replicated over tp (planner-deepseek-facts A1), not 2 x heads x head_dim."""
    from moepipe.config import parse_config
    from moepipe.examples import example_spec
    from moepipe.mapping import Mapping
    from moepipe.trtllm.engine import engine_memory

    data = {"model": {"example": "tiny-deepseek-v2", "dtype": "bfloat16"},
            "target": "trtllm-engine",
            "build": {"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 128},
            "workdir": str(tmp_path)}
    cfg = parse_config(data, "moepipe.yaml", "")
    spec = example_spec("tiny-deepseek-v2")
    for tp in (1, 2, 4):
        mem = engine_memory(cfg, spec, Mapping.create(tp=tp))
        assert mem["kv_cache"] == 3 * (32 + 8) * 2 * 128 * 2


def test_engine_estimate_counts_deepseek_dense_layers_and_mla_shapes(tmp_path):
    """The engine pre-flight's GPU memory is the sizing model's: DeepSeek's first layers are
    dense MLPs (not 64 routed experts each) and its MLA projections have their own shapes, so
    the weights are exactly the per-tensor bytes the converter writes; the activation width is
    heads x v_head_dim (the attention output), not heads x the rope dimension. (The engine's
    estimate used to count every layer as MoE at an average width.)"""
    from moepipe.arch import get_family
    from moepipe.config import parse_config
    from moepipe.mapping import Mapping
    from moepipe.sizing.gpu import ACTIVATION_COEFF
    from moepipe.sizing.shapes import shape_of
    from moepipe.sizing.weights import Sharding, stage_weight_bytes
    from moepipe.trtllm.engine import engine_memory

    # deepseek-ai/DeepSeek-V2-Lite's config.json: 27 layers, the first dense, 64 experts,
    # no query compression (q_lora_rank null), kv_lora_rank 512, rope 64, v_head_dim 128.
    v2_lite = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "scoring_func": "softmax", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096}}
    spec = get_family("DeepseekV2ForCausalLM").spec(v2_lite, "DeepSeek-V2-Lite config.json")
    cfg = parse_config({"model": {"example": "tiny-deepseek-v2"}, "target": "trtllm-engine",
                        "workdir": str(tmp_path)}, "moepipe.yaml", "")
    shape = shape_of(spec)
    assert shape.dense_layers == (0,) and shape.mla
    for tp, pp in [(1, 1), (2, 1), (2, 3)]:
        usage = engine_memory(cfg, spec, Mapping.create(tp=tp, pp=pp))
        s = Sharding(tp, pp, 1, tp)
        assert usage["weights"] == max(stage_weight_bytes(shape, s, st, "none", "bfloat16")
                                       for st in range(pp))
        tokens = 8192  # min(max_num_tokens, max_batch_size x max_seq_len)
        assert usage["activations"] == 2 * tokens * 16 * 128 * ACTIVATION_COEFF[tp]
    # one GPU: the dense first layer's MLP (3 x 2048 x 10944) instead of an MoE layer's 64
    # routed + 2 shared experts (66 x 3 x 2048 x 1408) and router (64 x 2048, float32)
    whole = engine_memory(cfg, spec, Mapping.create(tp=1))["weights"]
    moe = 66 * 3 * 2048 * 1408 * 2 + 64 * 2048 * 4
    dense = 3 * 2048 * 10944 * 2
    all_moe = stage_weight_bytes(
        shape_of(type(spec)(**{**spec.to_dict(), "first_k_dense_replace": 0})),
        Sharding(1, 1, 1, 1), 0, "none", "bfloat16")
    assert all_moe - whole == moe - dense


def test_dense_layers_must_split_evenly():
    from moepipe.examples import example_spec
    from moepipe.mapping import Mapping, mapping_problems

    spec = example_spec("tiny-deepseek-v2")  # dense intermediate 96
    assert not mapping_problems(spec, Mapping.create(tp=4))
    odd = type(spec)(**{**spec.to_dict(), "dense_intermediate_size": 90})
    assert "dense intermediate size 90 is not divisible by tp=4" in \
        mapping_problems(odd, Mapping.create(tp=4))


def test_inspect_describes_mla_routing_and_dense_layers(examples):
    from moepipe.stages.inspect import format_inspection, inspect_checkpoint

    data = inspect_checkpoint(examples["tiny-deepseek-v3"]).data
    assert data["attention"].startswith("MLA: q_lora_rank 48, kv_lora_rank 32")
    assert data["routing"].startswith("sigmoid + correction bias, best 2 of 4 groups (top2_sum)")
    # only the 2 MoE layers have inactive experts: 6 of 8, each 3 x 32 x 64
    p = data["parameters"]
    assert p["total"] - p["active_per_token"] == 2 * 6 * 3 * 32 * 64
    assert "attention       MLA" in format_inspection(data)
    v2 = inspect_checkpoint(examples["tiny-deepseek-v2"]).data
    assert v2["routing"] == "group-limited (DEVICE_LIMITED)"


def test_full_width_deepseek_v3_plans_to_the_planners_bytes():
    """DeepSeek-V3's published config (planner/configs/deepseek-v3.json) cut to 5 layers (its 3
    dense + 2 MoE; full widths: 7168 hidden, 128 heads, 256 experts), built on the meta device:
    the converter plans every rank without weights, and each holds exactly the bytes
    `moepipe plan` predicts (bf16, TensorRT-LLM layout). At 61 layers, tp=8 moe_ep=8, both say
    173,122,297,856 bytes for rank 0."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from moepipe.arch import get_family
    from moepipe.conversion.plan import plan_conversion
    from moepipe.mapping import Mapping
    from moepipe.sizing.shapes import model_shape
    from moepipe.sizing.weights import Sharding, stage_weight_bytes

    path = Path(__file__).parents[2] / "pipeline/moepipe/planner/configs/deepseek-v3.json"
    cfg = {**json.loads(path.read_text()), "num_hidden_layers": 5}
    family = get_family(cfg["architectures"][0])
    spec = family.spec(cfg, str(path))
    assert spec.rope_scaling["factor"] == 40 and spec.mtp_layers == 1
    skip = ("architectures", "auto_map", "model_type", "quantization_config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in skip}))

    shape = model_shape(cfg, "DeepSeek-V3 (5 layers)")
    for tp, pp, moe_tp, moe_ep in [(8, 1, 1, 8), (8, 1, 8, 1), (4, 2, 2, 2)]:
        plan = plan_conversion(family, spec, Mapping.create(tp=tp, pp=pp, moe_tp=moe_tp,
                                                            moe_ep=moe_ep), "bfloat16",
                               MetaReader(model))
        s = Sharding(tp, pp, moe_tp, moe_ep)
        for rank in range(tp * pp):
            assert plan.rank_bytes(rank) == stage_weight_bytes(shape, s, rank // tp, "none",
                                                               "bfloat16")
