"""Family specifics of OLMoE and GPT-OSS that parity with transformers (tests/e2e/test_parity.py)
does not show by itself: what the GPU targets refuse, what a checkpoint may not carry, and the
per-rank shapes of the published full-size configs (meta device, no weights)."""

import pytest
import torch
from meta_reader import MetaReader
from transformers import AutoModelForCausalLM, GptOssConfig, OlmoeConfig

from moepipe.arch import get_family
from moepipe.config import parse_config
from moepipe.conversion.plan import plan_conversion, unmapped_tensors
from moepipe.errors import UnsupportedError
from moepipe.mapping import Mapping
from moepipe.targets import check_family

# allenai/OLMoE-1B-7B-0924 config.json (the fields that shape tensors)
OLMOE_1B_7B = dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                   num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                   num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                   max_position_embeddings=4096, rope_theta=10000.0, clip_qkv=None,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)


# openai/gpt-oss-20b config.json (bf16 shapes; the published weights are MXFP4)
GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                   num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                   max_position_embeddings=131072, swiglu_limit=7.0,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                    "original_max_position_embeddings": 4096})


def _meta_plan(config, arch, **mapping):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    family = get_family(arch)
    spec = family.spec({**config.to_dict(), "architectures": [arch]}, "meta")
    reader = MetaReader(model)
    plan = plan_conversion(family, spec, Mapping.create(**mapping), "bfloat16", reader)
    assert unmapped_tensors(plan, reader.shapes, family) == []
    return plan


@pytest.mark.parametrize("target", ["trtllm-engine", "trtllm-pytorch"])
def test_gpu_targets_refuse_olmoe_before_the_build_runs(target, tmp_path):
    """TensorRT-LLM 1.2 has no OLMoE (engine or PyTorch backend): the build's pre-flight
    refuses it in one line; the cpu target and the other families pass."""
    from moepipe.stages.base import BuildContext
    from moepipe.stages.inspect import STAGE

    def preflight(example, tgt):
        data = {"model": {"example": example}, "target": tgt, "workdir": str(tmp_path)}
        cfg = parse_config(data, "moepipe.yaml", "").resolve_paths(tmp_path)
        STAGE.preflight(BuildContext(cfg, lambda s: None))

    with pytest.raises(UnsupportedError) as err:
        preflight("tiny-olmoe", target)
    assert "OlmoeForCausalLM cannot be" in str(err.value) and "TensorRT-LLM 1.2" in str(err.value)
    assert "\n" not in str(err.value) and "target: cpu" in err.value.hint
    preflight("tiny-olmoe", "cpu")
    preflight("tiny-mixtral", target)
    check_family(get_family("MixtralForCausalLM"), target)


def test_olmoe_clip_qkv_is_refused():
    cfg = {**OlmoeConfig(**{**OLMOE_1B_7B, "clip_qkv": 8.0}).to_dict(),
           "architectures": ["OlmoeForCausalLM"]}
    with pytest.raises(UnsupportedError, match="clip_qkv 8.0"):
        get_family("OlmoeForCausalLM").spec(cfg, "config.json")


def test_olmoe_1b_7b_shapes_on_meta_device():
    """q/k norms span the whole projection: each rank keeps its heads' slice of the weight."""
    plan = _meta_plan(OlmoeConfig(**OLMOE_1B_7B), "OlmoeForCausalLM", tp=4, moe_ep=4)
    s = {t.name: t.shape for t in plan.ranks[1]}
    assert s["transformer.layers.0.attention.q_layernorm.weight"] == (2048 // 4,)
    assert s["transformer.layers.0.attention.k_layernorm.weight"] == (2048 // 4,)
    assert s["transformer.layers.0.attention.qkv.weight"] == (3 * 2048 // 4, 2048)
    assert s["transformer.layers.0.mlp.fc.weight"] == (16, 2 * 1024, 2048)
    assert s["transformer.layers.0.mlp.router.weight"] == (64, 2048)
    assert plan.config()["moe"]["normalization_mode"] == 0  # softmax -> top-k, no renorm
    assert plan.config()["qk_layernorm"] is True


def test_gpt_oss_is_refused_by_the_engine_target_only(tmp_path):
    """TensorRT-LLM 1.2 serves GPT-OSS on the PyTorch backend only."""
    from moepipe.stages.base import BuildContext
    from moepipe.stages.inspect import STAGE

    for target in ("cpu", "trtllm-pytorch", "trtllm-engine"):
        data = {"model": {"example": "tiny-gpt-oss"}, "target": target,
                "workdir": str(tmp_path)}
        cfg = parse_config(data, "moepipe.yaml", "").resolve_paths(tmp_path)
        if target != "trtllm-engine":
            STAGE.preflight(BuildContext(cfg, lambda s: None))
            continue
        with pytest.raises(UnsupportedError, match="PyTorch backend only") as err:
            STAGE.preflight(BuildContext(cfg, lambda s: None))
        assert "target: trtllm-pytorch" in err.value.hint


def _mxfp4_pair(src, root):
    """(an MXFP4 copy of the GPT-OSS checkpoint ``src`` with random packed experts, the same
    model with those experts dequantized by transformers' ``convert_moe_packed_tensors``)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(3)
    packed, plain = root / "mxfp4", root / "dequantized"
    for d in (packed, plain):
        shutil.copytree(src, d)
    tensors = load_file(src / "model.safetensors")
    mx, deq = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, inp, out = tensors[name].shape  # bf16 layout [E, in, out]
        blocks = torch.randint(0, 256, (e, out, inp // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 128, (e, out, inp // 32), generator=gen, dtype=torch.uint8)
        del mx[name]
        mx[name + "_blocks"], mx[name + "_scales"] = blocks, scales
        deq[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(mx, packed / "model.safetensors", metadata={"format": "pt"})
    save_file(deq, plain / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(cfg))
    return packed, plain


@pytest.mark.parametrize("mapping", [dict(tp=2, moe_tp=2), dict(tp=2, moe_ep=2)],
                         ids=["mtp2", "mep2"])
def test_gpt_oss_mxfp4_converts_exactly_as_transformers_dequantizes(mapping, examples,
                                                                    tmp_path):
    """OpenAI's MXFP4 experts are read dequantized: the converted ranks are byte-identical to
    converting the weights transformers dequantizes (integrations/mxfp4.py); FP4 x 2^k is exact
    in float32, so nothing is lost."""
    from moepipe.conversion.write import convert

    packed, plain = _mxfp4_pair(examples["tiny-gpt-oss"], tmp_path)
    a = convert(packed, tmp_path / "a", **mapping)
    b = convert(plain, tmp_path / "b", **mapping)
    assert a.files == b.files  # sha256 of config.json and every rank file


def test_gpt_oss_mxfp4_logits_match_transformers_own_mxfp4_loader(examples, tmp_path):
    """The same packed folder loaded by transformers (Mxfp4Config(dequantize=True)) and
    converted by moepipe (tp=2, moe_ep=2) gives the same logits."""
    from transformers import Mxfp4Config

    from moepipe.conversion.write import convert
    from moepipe.runtime.checkpoint import load_checkpoint
    from moepipe.runtime.model import Batch, ReferenceModel

    packed, _ = _mxfp4_pair(examples["tiny-gpt-oss"], tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(
        packed, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    convert(packed, tmp_path / "ckpt", tp=2, moe_ep=2)
    ids = [54, 260, 402, 305, 77, 445, 510, 271, 494]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = ReferenceModel(load_checkpoint(tmp_path / "ckpt")).forward(Batch.single(ids),
                                                                      all_logits=True)
    assert (ours - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_mxfp4_of_other_families_is_refused(tmp_path):
    import json

    from moepipe.arch.hf import open_hf_checkpoint

    cfg = {**OlmoeConfig(**OLMOE_1B_7B).to_dict(), "architectures": ["OlmoeForCausalLM"],
           "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="MXFP4 OlmoeForCausalLM checkpoints"):
        open_hf_checkpoint(tmp_path)


def test_gpt_oss_20b_shapes_and_config_on_meta_device():
    """Sinks split with the heads; experts transposed from [H, 2I] / [I, H]; biases kept."""
    plan = _meta_plan(GptOssConfig(**GPT_OSS_20B), "GptOssForCausalLM", tp=4, moe_ep=4)
    s = {t.name: t.shape for t in plan.ranks[2]}
    layer = "transformer.layers.0."
    assert s[layer + "attention.qkv.weight"] == ((64 // 4 + 2 * 8 // 4) * 64, 2880)
    assert s[layer + "attention.qkv.bias"] == ((64 // 4 + 2 * 8 // 4) * 64,)
    assert s[layer + "attention.dense.bias"] == (2880,)
    assert s[layer + "attention.sinks"] == (16,)
    assert s[layer + "mlp.router.bias"] == (32,)
    assert s[layer + "mlp.fc.weight"] == (8, 2 * 2880, 2880)
    assert s[layer + "mlp.fc.bias"] == (8, 2 * 2880)
    assert s[layer + "mlp.proj.weight"] == (8, 2880, 2880)
    assert s[layer + "mlp.proj.bias"] == (8, 2880)
    cfg = plan.config()
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == 128 and cfg["swiglu_limit"] == 7.0
    assert cfg["rotary_scaling"] == {"type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 4096}
    assert cfg["moepipe_routing"]["router_bias"] is True
    assert cfg["moe"]["normalization_mode"] == 1  # top-k of the biased logits, then softmax


@pytest.mark.parametrize("config,arch,total", [
    (OlmoeConfig(**OLMOE_1B_7B), "OlmoeForCausalLM", 6_919_161_856),  # model card: 6.9B
    (GptOssConfig(**GPT_OSS_20B), "GptOssForCausalLM", 20_914_757_184),  # model card: 20.9B
])
def test_planner_counts_every_parameter(config, arch, total):
    """`moepipe plan` reads both families: its arithmetic equals transformers' meta model
    (q/k norms over the projection, sinks, router and expert biases included)."""
    from moepipe.sizing.shapes import model_shape

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = model_shape({**config.to_dict(), "architectures": [arch]}, arch)
    assert shape.parameters() == sum(p.numel() for p in model.parameters()) == total


@pytest.mark.parametrize("arch", ["OlmoeForCausalLM", "GptOssForCausalLM"])
def test_quantizing_olmoe_or_gpt_oss_is_refused_in_one_line(arch):
    """modelopt's export does not take OLMoE's unfused experts (it expects Mixtral's w1/w2/w3)
    and GPT-OSS's experts are computed, not sliced: both refuse before any stage runs."""
    from moepipe.arch.family import check_quantizable

    with pytest.raises(UnsupportedError, match=f"does not quantize {arch}"):
        check_quantizable(get_family(arch), "fp8")
    check_quantizable(get_family(arch), "none")
    check_quantizable(get_family("MixtralForCausalLM"), "fp8")


def test_inspect_counts_mxfp4_parameters(examples, tmp_path):
    """Two FP4 values per byte of the blocks; the scales are not parameters."""
    from moepipe.stages.inspect import inspect_checkpoint

    packed, plain = _mxfp4_pair(examples["tiny-gpt-oss"], tmp_path)
    assert inspect_checkpoint(packed).data["parameters"] == \
        inspect_checkpoint(plain).data["parameters"]
