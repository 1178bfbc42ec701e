"""Stage ``quantize``: modelopt post-training quantization, exported as modelopt's unified
Hugging Face checkpoint (what the trtllm-pytorch target serves; the converter turns it into a
TensorRT-LLM quantized checkpoint for the other targets).

* Formats: ``fp8``, ``int8_sq`` (SmoothQuant), ``int4_awq`` (block 128) on CPU; ``w4a8_awq`` and
  ``nvfp4`` need a GPU. KV cache: ``fp8`` or ``int8``.
* Calibration text comes from a local file or, by default, the held-out chapters of the corpus
  shipped with moepipe (text the trained examples never saw); nothing is downloaded. The
  sequences after the calibration ones are kept (``heldout.json``) for the quality stage.
* Experts are unfused first so that calibration, smoothing and AWQ reach every expert;
  ``moe_calib_experts_ratio=1.0`` routes calibration tokens through all experts.
* Routers and shared-expert gates are never quantized (checked after calibration).
* ``int8_sq`` leaves the routed experts in the model dtype: TensorRT-LLM has no SmoothQuant MoE
  kernels, and what is measured must be what is deployed.
* The export (:func:`moepipe.quant.recipe.export_unified`) holds exactly what modelopt's own
  TensorRT-LLM exporter writes from the same calibration (checked by ``tests/oracle``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, TextIO

from moepipe.config import GPU_ONLY_FORMATS, MoepipeConfig
from moepipe.errors import ConfigError, EnvironmentMissing, MoepipeError, UnsupportedError
from moepipe.quant.recipe import FORMATS, export_unified, quant_config
from moepipe.stages.base import BuildContext, Stage, gib
from moepipe.stages.source import source_spec
from moepipe.utils.bounded import ReadError, read_prefix

AWQ_BLOCK = 128
HELDOUT = "heldout.json"
# Modules that must stay unquantized (routers, shared-expert gate), by name fragment.
NEVER_QUANTIZED = (".gate.", "block_sparse_moe.gate", "shared_expert_gate", "router")


def check_environment(fmt: str) -> None:
    """Fail fast on a machine that cannot quantize ``fmt``."""
    import importlib.util

    if importlib.util.find_spec("modelopt") is None:
        raise EnvironmentMissing("quantization needs NVIDIA Model Optimizer (nvidia-modelopt)",
                                 "pip install 'moepipe[quantize]'")
    if fmt in GPU_ONLY_FORMATS:
        import torch

        if not torch.cuda.is_available():
            raise EnvironmentMissing(
                f"quantize.format {fmt} needs an NVIDIA GPU for calibration and none is "
                "visible here", "build on a GPU machine, or choose fp8, int8_sq or int4_awq")


def check_dimensions(fmt: str, spec) -> None:
    if fmt not in ("int4_awq", "w4a8_awq"):
        return
    dims = {"hidden_size": spec.hidden_size, "attention width": spec.attn_width,
            "expert intermediate size": spec.expert_intermediate_size}
    if spec.shared_expert_intermediate_size:
        dims["shared expert intermediate size"] = spec.shared_expert_intermediate_size
    bad = [f"{k} {v}" for k, v in dims.items() if v % AWQ_BLOCK]
    if bad:
        raise UnsupportedError(f"{fmt} quantizes in blocks of {AWQ_BLOCK} input channels; "
                               f"{', '.join(bad)} is not a multiple of {AWQ_BLOCK}",
                               "choose fp8 or int8_sq for this model")


# Bytes of a calibration set read per token needed: a token is a few bytes of text; the rest of
# a large dataset is never read (it was read and tokenized whole).
CALIBRATION_BYTES_PER_TOKEN = 64


def _dataset_texts(path: Path, field: str, tokens: int) -> list[str]:
    """The texts of a .txt or .jsonl calibration set, as far as ``tokens`` tokens need."""
    limit = max(CALIBRATION_BYTES_PER_TOKEN * tokens, 1 << 20)
    try:
        raw, whole = read_prefix(path, limit, "calibration set")
    except ReadError as e:
        raise ConfigError(f"quantize.calibration.dataset: {e.message}", e.hint) from None
    if path.suffix != ".jsonl":
        return [raw.decode("utf-8", errors="replace")]
    lines = raw.split(b"\n")
    if not whole:
        lines.pop()  # cut off at the limit
    texts = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                texts.append(str(json.loads(line)[field]))
            except (ValueError, KeyError, TypeError, RecursionError):
                raise ConfigError(f"{path}:{n}: not a JSON object with a '{field}' field",
                                  "set quantize.calibration.text_field") from None
    return texts


def calibration_tokens(cfg: MoepipeConfig, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(calibration sequences, held-out sequences) of ``seq_len`` tokens each."""
    from moepipe.examples.trained import heldout_text

    cal = cfg.quantize.calibration
    if cal.dataset is None:
        texts = [heldout_text()]  # text the trained examples never saw
    elif not cal.dataset.is_file():
        raise ConfigError(f"quantize.calibration.dataset: {cal.dataset} does not exist",
                          "give a local .txt or .jsonl file (nothing is downloaded)")
    else:
        texts = _dataset_texts(cal.dataset, cal.text_field,
                               (cal.samples + cal.eval_samples) * cal.seq_len)
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False).input_ids
    need = (cal.samples + cal.eval_samples) * cal.seq_len
    if len(stream) < need:
        raise ConfigError(
            f"the calibration text has {len(stream)} tokens; {cal.samples} calibration + "
            f"{cal.eval_samples} held-out sequences of {cal.seq_len} tokens need {need}",
            "give more text (quantize.calibration.dataset) or lower samples / seq_len")
    seqs = [stream[i * cal.seq_len:(i + 1) * cal.seq_len]
            for i in range(cal.samples + cal.eval_samples)]
    return seqs[:cal.samples], seqs[cal.samples:]


def run_quantize(cfg: MoepipeConfig, source: Path, out: Path, echo=print,
                 step=lambda text: None, log_path: Path | None = None) -> dict[str, Any]:
    """Quantize the checkpoint at ``source`` into ``out`` (a unified HF checkpoint).
    modelopt's own prints and warnings go to ``log_path`` (when given)."""
    with _tool_output(log_path):
        return _run_quantize(cfg, source, out, echo, step)


@contextlib.contextmanager
def _tool_output(log_path: Path | None):
    """Send what modelopt and transformers print (stdout, warnings) to a log file."""
    if log_path is None:
        yield
        return
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")  # transformers adds its handler on first use
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as f, contextlib.redirect_stdout(f), \
            warnings.catch_warnings():
        warnings.simplefilter("always")
        def _to_log(message: Warning | str, category: type[Warning], filename: str,
                    lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
            f.write(warnings.formatwarning(message, category, filename, lineno, line))

        warnings.showwarning = _to_log
        handler = logging.StreamHandler(f)
        hf_logger = logging.getLogger("transformers")
        saved = hf_logger.handlers[:], hf_logger.propagate
        hf_logger.handlers, hf_logger.propagate = [handler], False
        try:
            yield
        finally:
            hf_logger.handlers, hf_logger.propagate = saved


def _run_quantize(cfg: MoepipeConfig, source: Path, out: Path, echo, step) -> dict[str, Any]:
    from moepipe.arch.hf import open_hf_checkpoint

    q = cfg.quantize
    check_environment(q.format)
    ckpt = open_hf_checkpoint(source)
    check_dimensions(q.format, ckpt.spec)

    import torch
    from modelopt.torch.quantization import quantize as mtq_quantize
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from moepipe.quant.unfuse import unfuse_experts

    hf_logging.disable_progress_bar()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trust = cfg.model.trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    calib, heldout = calibration_tokens(cfg, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                 trust_remote_code=trust).eval().to(device)
    unfused = unfuse_experts(model, ckpt.family.expert_names)
    batch = q.calibration.batch_size

    def forward_loop(m):
        with torch.no_grad():
            for i in range(0, len(calib), batch):
                step(f"calibration batch {i // batch + 1}/{-(-len(calib) // batch)}")
                m(input_ids=torch.tensor(calib[i:i + batch], device=device))

    echo(f"  quantize: {q.format} (kv cache {q.kv_cache}), {len(calib)} calibration sequences "
         f"x {q.calibration.seq_len} tokens on {device}")
    mtq_quantize(model, quant_config(q.format, q.kv_cache), forward_loop)
    quantized, never = _inspect_quantizers(model)
    if never:
        raise MoepipeError(f"router / gate modules were quantized: {', '.join(never[:3])} "
                           "(a moepipe bug)")
    extra = _int8_kv_scales(model) if q.kv_cache == "int8" else {}
    if ckpt.spec.torch_dtype in ("float16", "bfloat16"):  # calibrated in float32, kept 16-bit
        model = model.to(getattr(torch, ckpt.spec.torch_dtype))
    # q/k/v and gate/up share their scales before the export (as modelopt's TensorRT-LLM
    # exporter does), so the converter never requantizes (moepipe.quant.recipe)
    export_unified(model.cpu(), out, ckpt.family.expert_names, extra_state_dict=extra or None)
    _fix_quant_config(out, q.kv_cache)
    for path in source.iterdir():  # the tokenizer travels with the checkpoint
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges",
                                 "added_tokens", "chat_template")) and path.is_file():
            shutil.copy2(path, out / path.name)
    (out / HELDOUT).write_text(json.dumps({"seq_len": q.calibration.seq_len,
                                           "sequences": heldout}) + "\n")
    return {"format": q.format, "kv_cache": q.kv_cache, "quant_algo": FORMATS[q.format][1],
            "calibration_sequences": len(calib), "calibration_tokens": len(calib) * len(calib[0]),
            "unfused_moe_layers": unfused, "quantized_modules": quantized, "device": device}


def _inspect_quantizers(model) -> tuple[int, list[str]]:
    """How many modules got an enabled weight quantizer, and which routers did (none!)."""
    quantized, never = 0, []
    for name, module in model.named_modules():
        wq = getattr(module, "weight_quantizer", None)
        if wq is not None and getattr(wq, "is_enabled", False):
            quantized += 1
            if any(frag in name + "." for frag in NEVER_QUANTIZED) and "experts" not in name:
                never.append(name)
    return quantized, never


def _int8_kv_scales(model) -> dict[str, Any]:
    """modelopt's unified export takes FP8 KV scales only. For INT8 the scales (amax / 127)
    are written as ``k_proj.k_scale`` / ``v_proj.v_scale`` like FP8's, and the quantizers are
    switched off before export."""
    import torch

    extra = {}
    for name, module in model.named_modules():
        for kind in ("k", "v"):
            quantizer = getattr(module, f"{kind}_bmm_quantizer", None)
            if quantizer is None or quantizer.amax is None:
                continue
            scale = (quantizer.amax.float().max() / 127.0).reshape(())
            extra[f"{name}.{kind}_proj.{kind}_scale"] = scale.to(torch.float32).cpu()
            quantizer.reset_amax()  # else the export still finds (and rejects) its amax
            quantizer.disable()
    return extra


def _fix_quant_config(out: Path, kv_cache: str) -> None:
    if kv_cache != "int8":
        return
    path = out / "hf_quant_config.json"
    data = json.loads(path.read_text())
    data["quantization"]["kv_cache_quant_algo"] = "INT8"
    path.write_text(json.dumps(data, indent=4) + "\n")
    cfg_path = out / "config.json"
    config = json.loads(cfg_path.read_text())
    qc = config.get("quantization_config", {})
    qc["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "int"}
    config["quantization_config"] = qc
    cfg_path.write_text(json.dumps(config, indent=2) + "\n")


def quantize_memory(param_count: int) -> int:
    """Peak host bytes: modelopt holds the model in float32 with quantizer state and the
    export makes quantized copies (about 2.2x the float32 weights), plus about 1 GiB for
    torch, transformers and modelopt."""
    return int(param_count * 4 * 2.2) + (1 << 30)


# -- the stage ---------------------------------------------------------------------------------
def _settings(cfg: MoepipeConfig) -> dict[str, Any]:
    q = cfg.quantize
    cal = q.calibration.model_dump(mode="json")
    if q.calibration.dataset is not None:  # the data, not where it lives, shapes the output
        from moepipe.checkpoints.hashcache import cached_digest

        cal["dataset"] = cached_digest(q.calibration.dataset) \
            if q.calibration.dataset.is_file() else str(q.calibration.dataset)
    return {"format": q.format, "kv_cache": q.kv_cache, "calibration": cal,
            "trust_remote_code": cfg.model.trust_remote_code}


def _preflight(ctx: BuildContext) -> None:
    check_environment(ctx.cfg.quantize.format)
    dataset = ctx.cfg.quantize.calibration.dataset
    if dataset is not None and not dataset.is_file():
        raise ConfigError(f"quantize.calibration.dataset: {dataset} does not exist",
                          "give a local .txt or .jsonl file (nothing is downloaded)")
    spec = source_spec(ctx)
    if spec is not None:
        from moepipe.arch import get_family
        from moepipe.arch.family import check_quantizable

        check_quantizable(get_family(spec.architecture), ctx.cfg.quantize.format)
        check_dimensions(ctx.cfg.quantize.format, spec)
    source = ctx.source_dir
    if source is not None and (source / "config.json").is_file():
        from moepipe.arch.hf import tokenizer_files

        tokenizer_files(source)  # calibration tokenizes text


def _run(ctx: BuildContext, out: Path) -> dict[str, Any]:
    return run_quantize(ctx.cfg, ctx.model_dir, out, echo=ctx.echo, step=ctx.step,
                        log_path=ctx.cfg.workdir / "logs" / "quantize.log")


def _memory(ctx: BuildContext) -> int:
    from moepipe.sizing.shapes import shape_of

    spec = source_spec(ctx)
    return 0 if spec is None else quantize_memory(shape_of(spec).parameters())


def _estimate(ctx: BuildContext) -> dict[str, Any]:
    q = ctx.cfg.quantize
    cal = q.calibration
    return {"format": f"{q.format} (kv cache {q.kv_cache}), {cal.samples} x {cal.seq_len} "
                      f"calibration tokens from {cal.dataset or 'the built-in corpus'}",
            "host memory (peak)": gib(_memory(ctx))}


STAGE = Stage("quantize", 1, applies=lambda cfg: cfg.quantize.format != "none",
              settings=_settings, inputs=("source",),
              tools=("nvidia-modelopt", "torch", "transformers"), run=_run, estimate=_estimate,
              memory=_memory, memory_hint="quantize on a machine with more memory (modelopt "
                                          "holds the model in float32)",
              preflight=_preflight, link="quantized", hf_checkpoint=True)
