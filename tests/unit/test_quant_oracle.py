"""moepipe's quantized TensorRT-LLM checkpoints against the oracle: modelopt 0.47's own
(deprecated) TensorRT-LLM exporter, ``export_tensorrt_llm_checkpoint``.

``tests/oracle/golden`` holds, per case, modelopt's unified export of a calibrated tiny Mixtral
(as moepipe's quantize stage writes it) and what the TensorRT-LLM exporter wrote from the very
same calibrated model at tp=1 and tp=2 (see ``tests/oracle/make_oracle.py``; regenerate with
``tests/oracle/make-oracle.sh``). Here moepipe converts the unified export and every tensor and
config key is compared: quantized and 16-bit tensors byte for byte, float32 scales within 1e-6,
names, dtypes and shapes exactly. The differences that are intended are listed below, each with
its reason; anything else fails.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moepipe.conversion.write import convert
from moepipe.errors import UnsupportedError

GOLDEN = Path(__file__).resolve().parents[1] / "oracle" / "golden"
CASES = [(case, tp) for case in ("fp8", "fp8_kv", "int8_sq", "int4_awq") for tp in (1, 2)]

# -- intended differences -------------------------------------------------------------------
# modelopt's own fields, written by its exporter's fallback config path (TensorRT-LLM is not
# importable where it runs); TensorRT-LLM takes unknown keys as attributes and ignores them.
ORACLE_ONLY_KEYS = {"bias", "decoder", "lm_head_bias", "rank", "rmsnorm", "rotary_pct",
                    "share_embedding_table"}
# TensorRT-LLM 1.2 LLaMAConfig / PretrainedConfig fields that modelopt's fallback path leaves
# out; moepipe writes them with TensorRT-LLM's defaults (tests/unit/test_format.py pins them).
MOEPIPE_ONLY_KEYS = {"attention_multiplier", "attn_bias", "disable_weight_only_quant_plugin",
                     "embedding_multiplier", "fc_after_embed", "layer_idx_offset", "mlp_bias",
                     "output_multiplier_scale", "qk_layernorm", "remove_duplicated_kv_heads",
                     "residual_multiplier", "rotary_embedding_dim", "rotary_scaling",
                     "runtime_defaults", "tie_word_embeddings",
                     "use_input_layernorm_in_first_layer", "use_last_layernorm"}
DIFFERENT_VALUES = {
    "producer": "who wrote the checkpoint",
    "logits_dtype": "modelopt writes float16 for bfloat16 models; moepipe keeps TensorRT-LLM's "
                    "default float32 (the logits tensor only)",
    "use_parallel_embedding": "modelopt splits the embedding table by vocabulary over the "
                              "ranks; moepipe replicates it (TensorRT-LLM's default); the "
                              "values are compared slice by slice",
}
# Blocks where modelopt writes a subset of the keys and moepipe TensorRT-LLM 1.2's full block
# (Mapping.to_dict, MoeConfig, QuantConfig): the keys modelopt writes must have equal values.
SUBSET_BLOCKS = {"mapping", "moe", "quantization"}
# Tensors only the oracle writes: modelopt also writes the per-K / per-V KV-cache scales for
# TensorRT-LLM <= 0.17 (its model_config_export.py says so); 1.2's Attention reads
# kv_cache_scaling_factor, which both write.
ORACLE_ONLY_TENSORS = re.compile(r".*\.attention\.[kv]_cache_scaling_factor$")


def _oracle(case: str, tp: int) -> dict:
    return json.loads((GOLDEN / case / f"oracle-tp{tp}.json").read_text())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """moepipe's conversion of each case's unified export (tp = moe_tp: the oracle has no EP)."""
    cache: dict[tuple[str, int], Path] = {}

    def get(case: str, tp: int) -> Path:
        if (case, tp) not in cache:
            out = tmp_path_factory.mktemp(case) / f"tp{tp}"
            convert(GOLDEN / case / "unified", out, tp=tp, moe_tp=tp, moe_ep=1)
            cache[case, tp] = out
        return cache[case, tp]

    return get


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _values(rec: dict) -> torch.Tensor:
    """An oracle tensor's values (stored for float32 tensors and small ones)."""
    dtype = getattr(torch, rec["dtype"])
    raw = bytearray(base64.b64decode(rec["raw"]))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(rec["shape"])


def _linear_modules(names) -> set[str]:
    """The modules TensorRT-LLM's quantizer may replace (linear layers) and the MoE blocks."""
    mods = set()
    for name in names:
        if name.endswith(".weight") and not re.search(r"(norm|embedding)\.weight$", name):
            module = name.removesuffix(".weight")
            mods.add(module)
            if re.search(r"\.mlp\.(fc|proj|router)$", module):
                mods.add(module.rsplit(".", 1)[0])
    return mods


def _excluded(module: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


@pytest.mark.parametrize("case,tp", CASES, ids=[f"{c}-tp{t}" for c, t in CASES])
def test_config_matches_the_oracle(converted, case, tp):
    oracle = _oracle(case, tp)["config"]
    ours = json.loads((converted(case, tp) / "config.json").read_text())
    assert set(oracle) - set(ours) == ORACLE_ONLY_KEYS
    assert set(ours) - set(oracle) == MOEPIPE_ONLY_KEYS
    for key in sorted(set(oracle) & set(ours)):
        if key in DIFFERENT_VALUES:
            continue
        if key in SUBSET_BLOCKS:
            for sub, value in oracle[key].items():
                if sub == "exclude_modules":
                    continue  # compared by what it excludes, below
                assert ours[key][sub] == value, f"{key}.{sub}: {ours[key][sub]} != {value}"
        else:
            assert ours[key] == oracle[key], f"{key}: {ours[key]} != {oracle[key]}"
    assert ours["logits_dtype"] == "float32" and ours["use_parallel_embedding"] is False
    # exclude_modules: modelopt lists module names (every router; for SmoothQuant each layer's
    # whole MoE block, `transformer.layers.N.mlp*`), moepipe patterns; they must exclude the
    # same linear layers and MoE blocks.
    names = _oracle(case, tp)["ranks"][0]
    for module in sorted(_linear_modules(names)):
        want = _excluded(module, oracle["quantization"]["exclude_modules"])
        got = _excluded(module, ours["quantization"]["exclude_modules"])
        assert got == want, f"{module}: excluded {got}, the oracle {want}"


@pytest.mark.parametrize("case,tp", CASES, ids=[f"{c}-tp{t}" for c, t in CASES])
def test_tensors_match_the_oracle(converted, case, tp):
    oracle = _oracle(case, tp)
    folder = converted(case, tp)
    for rank, want in enumerate(oracle["ranks"]):
        got = load_file(folder / f"rank{rank}.safetensors")
        expected = {n for n in want if not ORACLE_ONLY_TENSORS.match(n)}
        assert set(got) == expected, (sorted(set(got) - expected), sorted(expected - set(got)))
        for name in sorted(expected):
            rec, t = want[name], got[name]
            if name == "transformer.vocab_embedding.weight" and tp > 1:
                rows = t.shape[0] // tp  # the oracle's vocab-parallel slice of this rank
                t = t[rank * rows:(rank + 1) * rows]
            assert str(t.dtype).removeprefix("torch.") == rec["dtype"], name
            assert list(t.shape) == rec["shape"], name
            if rec["dtype"] == "float32":
                diff = (t - _values(rec)).abs().max().item()
                assert diff <= 1e-6, f"rank{rank} {name}: max difference {diff:.3g}"
            elif _awq_folded_norm(case, name):
                continue  # compared with its prequant scale, below
            else:
                assert hashlib.sha256(_raw(t)).hexdigest() == rec["sha256"], \
                    f"rank{rank} {name}: bytes differ from the oracle"
        if case == "int4_awq":
            _check_folded_qkv_smoothing(want, got)


def _awq_folded_norm(case: str, name: str) -> bool:
    return case == "int4_awq" and bool(re.search(
        r"\.(input_layernorm\.weight|attention\.qkv\.prequant_scaling_factor)$", name))


def _check_folded_qkv_smoothing(want: dict, got: dict) -> None:
    """INT4-AWQ q/k/v: modelopt's unified export folds their pre-quant scale into
    input_layernorm (its export-time ``fuse_prequant_layernorm``), so moepipe writes the folded
    norm and ones; the oracle writes the norm and the scale. TensorRT-LLM computes
    norm(x) * prequant_scaling_factor either way: the products agree to bfloat16 rounding."""
    for name in want:
        if not name.endswith("attention.qkv.prequant_scaling_factor"):
            continue
        norm = name.replace("attention.qkv.prequant_scaling_factor", "input_layernorm.weight")
        theirs = _values(want[norm]).float() * _values(want[name]).float()
        ours = got[norm].float() * got[name].float()
        assert torch.equal(got[name].float(), torch.ones_like(got[name].float()))
        assert torch.allclose(ours, theirs, rtol=2 ** -8, atol=0), norm


def test_stock_int8_sq_with_quantized_experts_is_refused(tmp_path, capsys):
    """modelopt's stock SmoothQuant quantizes the routed experts; TensorRT-LLM 1.2 has no
    SmoothQuant MoE, so `moepipe convert` refuses in one line with exit 2 (it used to crash
    with a traceback: too much data for '...mlp.fc.act_scale') and writes nothing."""
    from moepipe.cli import main

    stock = GOLDEN / "int8_sq_experts" / "unified"
    with pytest.raises(UnsupportedError, match="quantized routed experts"):
        convert(stock, tmp_path / "out", tp=1)
    with pytest.raises(SystemExit) as exit_:
        main(["convert", "--model", str(stock), "--output", str(tmp_path / "cli"), "--tp", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: this int8_sq"), err
    assert "(hint: quantize with moepipe" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_golden_files_are_small():
    sizes = {p: p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file()}
    assert max(sizes.values()) < 1 << 20
    assert sum(sizes.values()) < 1 << 20


def test_int8_sq_tensors_are_what_tensorrt_llm_12_non_plugin_layers_declare(converted):
    """TensorRT-LLM 1.2 (NVIDIA/TensorRT-LLM): W8A8_SQ_PER_CHANNEL is not in
    ``W8A8_SQ_PLUGIN_LIST`` (``tensorrt_llm/quantization/mode.py``), so ``smooth_quantize``
    takes ``smooth_quantize_ootb`` (``quantization/quantize.py``): ColumnLinear becomes
    ``Int8SmoothQuantLinear`` and RowLinear ``Int8SmoothQuantRowLinear``
    (``quantization/layers.py``), whose parameters are ``weight`` int8 [out, in],
    ``weights_scaling_factor`` float32 [out], ``activation_scaling_factor`` float32 [1] and
    ``prequant_scaling_factor`` [in] in the model dtype. Norms are not replaced (the plugin
    path's ``SmoothQuantRmsNorm`` and its ``scale_to_int`` are not used), and loading is strict:
    a missing parameter is "Required but not provided"."""
    folder = converted("int8_sq", 2)
    tensors = load_file(folder / "rank0.safetensors")
    hidden, heads, kv, head = 16, 4, 2, 4  # tests/oracle/make_oracle.py MODELS["tiny"]
    qkv_out = (heads + 2 * kv) * head // 2
    for layer in range(2):
        for linear, (out, inp) in {"attention.qkv": (qkv_out, hidden),
                                   "attention.dense": (hidden, heads * head // 2)}.items():
            p = f"transformer.layers.{layer}.{linear}"
            spec = {n.removeprefix(p + "."): (str(t.dtype), tuple(t.shape))
                    for n, t in tensors.items() if n.startswith(p + ".")}
            assert spec == {"weight": ("torch.int8", (out, inp)),
                            "weights_scaling_factor": ("torch.float32", (out,)),
                            "activation_scaling_factor": ("torch.float32", (1,)),
                            "prequant_scaling_factor": ("torch.bfloat16", (inp,))}, p
    plugin_names = ("act_scale", "per_channel_scale", "smoother", "scale_to_int")
    assert not [n for n in tensors if n.rsplit(".", 1)[-1] in plugin_names]
