"""Built-in tiny examples: MoE checkpoints with a real local tokenizer, random or trained.

``write_example(name, out)`` writes a Hugging Face folder (config.json, model.safetensors,
generation_config.json, tokenizer.json, ...) that ``AutoTokenizer`` / ``AutoModelForCausalLM``
load offline. The same name gives byte-identical files.

* Random examples (``tiny-mixtral``, ...): seeded random weights, written in a second; for tests
  that need speed or adversarial routers.
* Trained examples (``*-trained``): trained on CPU from a fixed seed on the shipped public-domain
  corpus (:mod:`moepipe.examples.trained`), once per machine (about a minute), so they continue
  a prompt with readable text and their router has learnt to spread tokens.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

from moepipe.errors import ConfigError
from moepipe.examples.example import Example
from moepipe.examples.train import Recipe
from moepipe.utils.fs import atomic_dir

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
BOS, EOS, PAD = 0, 1, 2


_COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
               bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)

# DeepSeek's YaRN (V2-Lite: mscale 0.707; V3: 1.0), scaled down to the tiny context
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32, beta_slow=1,
             original_max_position_embeddings=512)

EXAMPLES: dict[str, Example] = {
    "tiny-mixtral": Example(
        "MixtralConfig", "Mixtral-style: 8 experts, top-2, GQA (4 heads / 2 KV heads)",
        dict(_COMMON, vocab_size=512, intermediate_size=32, num_local_experts=8,
             num_experts_per_tok=2, rope_theta=1e6)),
    "tiny-mixtral-256": Example(
        "MixtralConfig", "Mixtral-style with hidden and expert sizes of 256: INT4-AWQ quantizes "
        "in blocks of 128 input channels, also per tp=2 shard",
        dict(_COMMON, hidden_size=256, num_hidden_layers=2, vocab_size=512, intermediate_size=256,
             num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6), seed=4567),
    "tiny-qwen2-moe": Example(
        "Qwen2MoeConfig", "Qwen2-MoE-style: 8 experts top-2 + gated shared expert, QKV bias, "
        "vocab 514 (not a multiple of 4: exercises lm_head padding)",
        dict(_COMMON, vocab_size=514, intermediate_size=128, moe_intermediate_size=32,
             shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=False, qkv_bias=True, rope_theta=1e6, decoder_sparse_step=1,
             mlp_only_layers=[], use_sliding_window=False), seed=2345),
    "tiny-qwen3-moe": Example(
        "Qwen3MoeConfig", "Qwen3-MoE-style: 8 experts top-2 with norm_topk_prob, q/k RMSNorm",
        dict(_COMMON, vocab_size=512, intermediate_size=128, moe_intermediate_size=32,
             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
             attention_bias=False, rope_theta=1e6, decoder_sparse_step=1, mlp_only_layers=[],
             use_sliding_window=False), seed=3456),
    "tiny-deepseek-v2": Example(
        "DeepseekV2Config", "DeepSeek-V2-Lite-style: MLA without query compression, YaRN, 1 "
        "dense layer, 8 experts top-2 in 4 groups (group-limited greedy), 2 shared experts",
        dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, vocab_size=512,
             intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
             n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1,
             topk_method="group_limited_greedy", n_group=4, topk_group=2,
             routed_scaling_factor=2.0, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, rope_parameters=dict(
                 _YARN, mscale=0.707, mscale_all_dim=0.707)), seed=5678),
    "tiny-deepseek-v3": Example(
        "DeepseekV3Config", "DeepSeek-V3-style: MLA with query compression, YaRN, 1 dense layer, "
        "8 experts top-2, sigmoid noaux_tc routing with a correction bias, 1 shared expert",
        dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, vocab_size=512,
             intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
             n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=4,
             topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=48,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0)), seed=6789),
    "tiny-olmoe": Example(
        "OlmoeConfig", "OLMoE-style: 8 experts, softmax -> top-2 without renormalisation, q/k "
        "RMSNorm over the whole projection",
        dict(_COMMON, vocab_size=512, intermediate_size=32, num_experts=8,
             num_experts_per_tok=2, norm_topk_prob=False, rope_theta=10000.0), seed=7890),
    "tiny-gpt-oss": Example(
        "GptOssConfig", "GPT-OSS-style: 8 experts top-2 with a biased router, attention sinks, "
        "sliding window (4 tokens) on alternate layers, YaRN, biased experts with the clamped "
        "SwiGLU (limit 1.5 so that the clamp acts)",
        dict(_COMMON, vocab_size=512, intermediate_size=32, num_local_experts=8,
             num_experts_per_tok=2, head_dim=16, sliding_window=4, swiglu_limit=1.5,
             attention_bias=True,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 64}), seed=8901),
}

# Trained examples: sizes that learn in about a minute on 2 cores, hidden and expert widths of
# 128 so every CPU quantization format (INT4-AWQ: blocks of 128 input channels) applies.
_TRAINED = dict(_COMMON, hidden_size=128, num_hidden_layers=2, vocab_size=1024,
                rope_theta=10000.0)
_QWEN_TRAINED = dict(_TRAINED, intermediate_size=128, moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                     use_sliding_window=False)
_UNROPED = {k: v for k, v in _TRAINED.items() if k != "rope_theta"}  # rope_parameters instead
_DEEPSEEK_TRAINED = dict(_UNROPED, num_key_value_heads=4, intermediate_size=256,
                         moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
                         first_k_dense_replace=1, n_group=4, topk_group=2, kv_lora_rank=64,
                         qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
EXAMPLES.update({
    "tiny-mixtral-trained": Example(
        "MixtralConfig", "Mixtral-style, trained on Pride and Prejudice: 8 experts top-2, GQA",
        dict(_TRAINED, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2),
        tokenizer_vocab=1024, seed=11, recipe=Recipe()),
    "tiny-qwen2-moe-trained": Example(
        "Qwen2MoeConfig", "Qwen2-MoE-style, trained on Pride and Prejudice: 8 experts top-2 + "
        "gated shared expert, QKV bias",
        dict(_QWEN_TRAINED, shared_expert_intermediate_size=128, norm_topk_prob=False,
             qkv_bias=True), tokenizer_vocab=1024, seed=12, recipe=Recipe()),
    "tiny-qwen3-moe-trained": Example(
        "Qwen3MoeConfig", "Qwen3-MoE-style, trained on Pride and Prejudice: 8 experts top-2 with "
        "norm_topk_prob, q/k RMSNorm",
        dict(_QWEN_TRAINED, norm_topk_prob=True, head_dim=32, attention_bias=False),
        tokenizer_vocab=1024, seed=13, recipe=Recipe()),
    "tiny-olmoe-trained": Example(
        "OlmoeConfig", "OLMoE-style, trained on Pride and Prejudice: 8 experts top-2 without "
        "renormalisation, q/k RMSNorm",
        dict(_TRAINED, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=False), tokenizer_vocab=1024, seed=14, recipe=Recipe()),
    "tiny-gpt-oss-trained": Example(
        "GptOssConfig", "GPT-OSS-style, trained on Pride and Prejudice: 8 experts top-2 with a "
        "biased router, attention sinks, sliding window (32 tokens) on alternate layers, YaRN, "
        "clamped SwiGLU (limit 3)",
        dict(_UNROPED, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
             head_dim=32, sliding_window=32, swiglu_limit=3.0, attention_bias=True,
             rope_parameters=EXAMPLES["tiny-gpt-oss"].config["rope_parameters"]),
        tokenizer_vocab=1024, seed=15, recipe=Recipe()),
    # DeepSeek: 1 dense layer + 1 MoE layer, MLA at a quarter of the widths of the real ones.
    # transformers has no balance loss for them: V2 trains with its paper's expert-level loss
    # (the Switch formula over the experts chosen), V3 with its paper's auxiliary-loss-free
    # correction-bias rule (rate 0.001, the paper's) and no auxiliary loss.
    "tiny-deepseek-v2-trained": Example(
        "DeepseekV2Config", "DeepSeek-V2-style, trained on Pride and Prejudice: MLA, YaRN, 1 "
        "dense layer, 8 experts top-2 in 4 groups (group-limited greedy), 2 shared experts",
        dict(_DEEPSEEK_TRAINED, n_shared_experts=2, topk_method="group_limited_greedy",
             routed_scaling_factor=2.0, q_lora_rank=None,
             rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707)),
        tokenizer_vocab=1024, seed=16, recipe=Recipe()),
    "tiny-deepseek-v3-trained": Example(
        "DeepseekV3Config", "DeepSeek-V3-style, trained on Pride and Prejudice: MLA with query "
        "compression, YaRN, 1 dense layer, 8 experts top-2, sigmoid noaux_tc routing balanced "
        "by the correction-bias rule, 1 shared expert",
        dict(_DEEPSEEK_TRAINED, n_shared_experts=1, norm_topk_prob=True,
             routed_scaling_factor=2.5, q_lora_rank=96,
             rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0)),
        tokenizer_vocab=1024, seed=17, recipe=Recipe(aux_loss_coef=0.0, bias_update_rate=1e-3)),
})


def random_examples() -> list[str]:
    """Names of the random-weight examples (instant; for fast and adversarial tests)."""
    return [name for name, ex in EXAMPLES.items() if not ex.trained]


def trained_examples() -> list[str]:
    """Names of the trained examples (about a minute each, once per machine)."""
    return [name for name, ex in EXAMPLES.items() if ex.trained]



def family_examples() -> dict[str, str]:
    """Registered architecture -> the first random-weight example of that family (tests cover
    every family through this; a family without an example is an error here)."""
    from moepipe.arch import REGISTRY

    found: dict[str, str] = {}
    for name, ex in EXAMPLES.items():
        if not ex.trained:  # tests need the instant ones
            found.setdefault(ex.config_class.removesuffix("Config") + "ForCausalLM", name)
    missing = sorted(set(REGISTRY) - set(found))
    if missing:
        raise ConfigError(f"no built-in example for {', '.join(missing)}")
    return {arch: found[arch] for arch in sorted(REGISTRY)}


def corpus_text() -> str:
    """The small public-domain corpus shipped for tokenizers, prompts and calibration."""
    return resources.files("moepipe.examples").joinpath("corpus.txt").read_text()


def build_tokenizer(vocab_size: int, text: str | None = None):
    """Train a byte-level BPE on ``text`` (default: the small shipped corpus), deterministic,
    and wrap it for HF."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((text or corpus_text()).splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=2048)


def _init_weights(model, seed: int) -> None:
    """Deterministic, well-conditioned random weights: unit-variance activations, decisive
    routers and norms that are not all ones (so a swapped norm cannot hide)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        # DeepSeek-V3's selection-only bias is a buffer: make it matter (scores are in (0, 1))
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
        # A random model picks </s> as often as any token; damp it so greedy runs go on long
        # enough to compare (a client's end_id still stops them).
        if not model.config.tie_word_embeddings:
            model.lm_head.weight[EOS] *= 0.1


def write_example(name: str, out: str | Path, overwrite: bool = False,
                  progress: Callable[[str], None] = lambda text: None,
                  untrained: bool = False) -> Path:
    """Write example ``name`` as a Hugging Face checkpoint folder at ``out``.

    A trained example is trained the first time on this machine (``progress`` reports its
    steps) and copied from the machine's cache afterwards; ``untrained=True`` writes it with
    seeded random weights instead (its exact shapes in a second: for tests)."""
    ex = _example(name)
    out = Path(out)
    recipe = None if untrained else ex.recipe
    if recipe is not None:
        from moepipe.examples.trained import cached_example

        folder, _ = cached_example(name, ex,
                                   lambda tmp: train_example_into(ex, recipe, tmp, progress))
        with atomic_dir(out, overwrite) as tmp:
            for f in sorted(folder.iterdir()):
                shutil.copyfile(f, tmp / f.name)
        return out
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tokenizer = build_tokenizer(ex.tokenizer_vocab)
    config = getattr(transformers, ex.config_class)(**ex.config, dtype="float32")
    torch.manual_seed(ex.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, ex.seed)
    with atomic_dir(out, overwrite) as tmp:
        _save(model, tokenizer, tmp)
    return out


def _save(model, tokenizer, folder: Path) -> None:
    import transformers

    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def train_example_into(ex: Example, recipe: Recipe, folder: Path,
                progress: Callable[[str], None]) -> dict[str, Any]:
    """Train ``ex`` from its seed on the corpus's training text and save it in ``folder``."""
    import torch
    import transformers

    from moepipe.examples.train import deterministic_torch, train
    from moepipe.examples.trained import CORPUS, TRAIN_CHAPTERS, training_text

    transformers.utils.logging.disable_progress_bar()
    text = training_text()
    tokenizer = build_tokenizer(ex.tokenizer_vocab, text)
    config = getattr(transformers, ex.config_class)(**ex.config, dtype="float32")
    with deterministic_torch(recipe.threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(ex.seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        ids = encoding.ids
        paragraphs = [n for n, (begin, _) in enumerate(encoding.offsets)
                      if (begin == 0 or text[begin - 1] == "\n") and text[begin] != "\n"]
        stats = train(model, ids, recipe, ex.seed, progress, paragraphs)
    _save(model, tokenizer, folder)
    return {"corpus": f"{CORPUS}, chapters 1-{TRAIN_CHAPTERS}", "training_tokens": len(ids),
            "recipe": asdict(recipe), "seed": ex.seed, **stats}


def _example(name: str) -> Example:
    if name not in EXAMPLES:
        raise ConfigError(f"unknown example '{name}'",
                          f"choose one of: {', '.join(sorted(EXAMPLES))}")
    return EXAMPLES[name]


def example_spec(name: str):
    """The :class:`~moepipe.arch.spec.ModelSpec` of example ``name`` without writing it."""
    import transformers

    from moepipe.arch import get_family

    ex = _example(name)
    config = getattr(transformers, ex.config_class)(**ex.config, dtype="float32").to_dict()
    arch = ex.config_class.replace("Config", "ForCausalLM")
    config["architectures"] = [arch]
    return get_family(arch).spec(config, f"example {name}")
