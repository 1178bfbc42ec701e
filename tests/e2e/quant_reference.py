"""The whole-model quantization path moepipe ran before layer-by-layer quantization, kept as
the reference that the layer-by-layer path must reproduce (tests/e2e/test_layerwise_equivalence.py
and tests/gpu): the model loaded whole in float32 with ``from_pretrained``, its experts unfused,
``mtq.quantize`` on the whole model over the calibration batches, INT8 KV scales taken out,
cast back to the checkpoint's 16-bit dtype, modelopt's unified export of the whole model.

Also the seeded tiny checkpoints those tests quantize: one per quantizable family, with the
dimensions every CPU format accepts (INT4-AWQ: blocks of 128 input channels).

Run as a script (modelopt patches transformers classes, so tests run it in a child process):
``python quant_reference.py ARCH DTYPE OUT CASE[,CASE...] [--device cpu|cuda] [--only layerwise]
[--variant tied|dead-expert] [--tag NAME]``
writes ``OUT/model`` and, per case ``fmt+kv``, ``OUT/<case>/whole`` and
``OUT/<case>/layerwise-<device or tag>`` (with the stage details beside it).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

# Per family: the config overrides of its built-in example that give hidden, attention and
# expert widths of 128, 2 layers and 4 experts. A quantizable family missing here fails the
# equivalence test (its list of families comes from the registry).
TINY_128 = {
    "MixtralForCausalLM": dict(hidden_size=128, intermediate_size=128, head_dim=32,
                               num_hidden_layers=2, num_local_experts=4, vocab_size=256),
    "Qwen2MoeForCausalLM": dict(hidden_size=128, moe_intermediate_size=128,
                                shared_expert_intermediate_size=128, num_hidden_layers=2,
                                num_experts=4, vocab_size=256),
    "Qwen3MoeForCausalLM": dict(hidden_size=128, moe_intermediate_size=128, head_dim=32,
                                num_hidden_layers=2, num_experts=4, vocab_size=256),
}
SEQUENCES, SEQ_LEN, BATCH = 10, 16, 4  # batches of 4, 4 and 2 sequences


def make_checkpoint(arch: str, dtype: str, out: Path, variant: str = "") -> Path:
    """The seeded tiny ``arch`` checkpoint (weights as the built-in examples draw them).
    ``variant``: ``tied`` ties lm_head to the embedding; ``dead-expert`` (Mixtral) gives it a
    fifth expert its routers never choose: each MoE block sees only the first channel of its
    normalized input (its norm weight is 1, 0, 0, ...) and routes with the logits
    ``x0 * (1, 2, -1, -2, 0)``, so the top 2 are experts 0 and 1 or 2 and 3, never 4."""
    import torch
    import transformers

    from moepipe.examples import EXAMPLES, _init_weights, family_examples

    ex = EXAMPLES[family_examples()[arch]]
    overrides = dict(TINY_128[arch])
    if variant == "tied":
        overrides["tie_word_embeddings"] = True
    if variant == "dead-expert":
        overrides["num_local_experts"] = 5
    config = getattr(transformers, ex.config_class)(**{**ex.config, **overrides},
                                                    dtype="float32")
    torch.manual_seed(ex.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, ex.seed)
    if variant == "dead-expert":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight.zero_()[0] = 1.0
                layer.mlp.gate.weight.zero_()[:, 0] = torch.tensor([1.0, 2.0, -1.0, -2.0, 0.0])
    model.to(getattr(torch, dtype)).save_pretrained(out)
    return out


def calibration(vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab, (SEQUENCES, SEQ_LEN), generator=gen).tolist()


def whole_model(source: Path, out: Path, fmt: str, kv: str, calib: list[list[int]],
                batch: int = BATCH, device: str = "cpu") -> None:
    """Quantize the whole model at once (moepipe's former quantize stage, less the tokenizer)."""
    import torch
    from modelopt.torch.quantization import quantize as mtq_quantize
    from transformers import AutoModelForCausalLM

    from moepipe.arch.hf import open_hf_checkpoint
    from moepipe.quant.recipe import export_unified, int8_kv_scales, mark_int8_kv, quant_config
    from moepipe.quant.unfuse import unfuse_experts

    ckpt = open_hf_checkpoint(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval().to(device)
    unfuse_experts(model, ckpt.family.expert_names)

    def forward_loop(m):
        with torch.no_grad():
            for i in range(0, len(calib), batch):
                m(input_ids=torch.tensor(calib[i:i + batch], device=device))

    mtq_quantize(model, quant_config(fmt, kv), forward_loop)
    extra = int8_kv_scales(model) if kv == "int8" else {}
    if ckpt.spec.torch_dtype in ("float16", "bfloat16"):
        model = model.to(getattr(torch, ckpt.spec.torch_dtype))
    export_unified(model.cpu(), out, ckpt.family.expert_names, extra_state_dict=extra or None)
    if kv == "int8":
        mark_int8_kv(out)


def layerwise(source: Path, out: Path, fmt: str, kv: str, calib: list[list[int]],
              batch: int = BATCH, device: str = "cpu") -> dict:
    from moepipe.arch.hf import open_hf_checkpoint
    from moepipe.quant.layerwise import Calibration, quantize_layerwise

    out.mkdir(parents=True)
    ckpt = open_hf_checkpoint(source)
    return quantize_layerwise(source, out, out.with_name(out.name + ".scratch"),
                              Calibration(fmt, kv, calib, batch, device),
                              ckpt.family.expert_names)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("arch")
    parser.add_argument("dtype")
    parser.add_argument("out", type=Path)
    parser.add_argument("cases")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=("whole", "layerwise"))
    parser.add_argument("--tag", help="names the layer-by-layer output (default: the device)")
    parser.add_argument("--variant", default="", choices=("", "tied", "dead-expert"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    source = args.out / "model"
    if not source.is_dir():
        make_checkpoint(args.arch, args.dtype, source, args.variant)
    calib = calibration(json.loads((source / "config.json").read_text())["vocab_size"])
    for case in args.cases.split(","):
        fmt, kv = case.split("+")
        if args.only != "layerwise":
            whole_model(source, args.out / case / "whole", fmt, kv, calib)
        if args.only != "whole":
            tag = args.tag or args.device
            details = layerwise(source, args.out / case / f"layerwise-{tag}", fmt, kv, calib,
                                device=args.device)
            (args.out / case / f"details-{tag}.json").write_text(json.dumps(details))


if __name__ == "__main__":
    main()
