"""Stage ``quantize``: modelopt post-training quantization, exported as modelopt's unified
Hugging Face checkpoint (what the trtllm-pytorch target serves; the converter turns it into a
TensorRT-LLM quantized checkpoint for the other targets).

* One decoder layer at a time (:mod:`moepipe.quant.layerwise`): memory is bounded by a layer
  in float32 and the calibration activations (:mod:`moepipe.quant.memory`), whatever the depth;
  the checkpoint equals what calibrating the whole model at once writes
  (``tests/e2e/test_layerwise_equivalence.py``). ``quantize.device``: the CPU, or a GPU one
  layer at a time. A killed build resumes at the first unfinished layer (the build keeps the
  stage's scratch folder); a live line per layer on a terminal.
* Formats: ``fp8``, ``int8_sq`` (SmoothQuant), ``int4_awq`` (block 128) on CPU; ``w4a8_awq`` and
  ``nvfp4`` need a GPU. KV cache: ``fp8`` or ``int8``.
* Calibration text comes from a local file or, by default, the held-out chapters of the corpus
  shipped with moepipe (text the trained examples never saw); nothing is downloaded. The
  sequences after the calibration ones are kept (``heldout.json``) for the quality stage.
* Experts are unfused first so that calibration, smoothing and AWQ reach every expert;
  ``moe_calib_experts_ratio=1.0`` routes calibration tokens through all experts (the record
  says, per layer, how many experts the router itself sent no token).
* Routers and shared-expert gates are never quantized (checked after calibration).
* ``int8_sq`` leaves the routed experts in the model dtype: TensorRT-LLM has no SmoothQuant MoE
  kernels, and what is measured must be what is deployed.
* The export holds exactly what modelopt's own TensorRT-LLM exporter writes from the same
  calibration (:func:`moepipe.quant.recipe.export_unified`, checked by ``tests/oracle``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any, TextIO

from moepipe.config import GPU_ONLY_FORMATS, MoepipeConfig
from moepipe.errors import ConfigError, EnvironmentMissing, MoepipeError, UnsupportedError
from moepipe.quant.recipe import FORMATS
from moepipe.stages.base import BuildContext, Stage, gib
from moepipe.stages.source import source_spec
from moepipe.utils.bounded import ReadError, read_prefix

AWQ_BLOCK = 128
HELDOUT = "heldout.json"


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


def run_quantize(cfg: MoepipeConfig, source: Path, out: Path, scratch: Path, echo=print,
                 step=lambda text: None, log_path: Path | None = None) -> dict[str, Any]:
    """Quantize the checkpoint at ``source`` into ``out`` (a unified HF checkpoint), one
    decoder layer at a time; ``scratch`` keeps finished layers for a rerun after a kill.
    modelopt's own prints and warnings go to ``log_path`` (when given)."""
    with _tool_output(log_path):
        return _run_quantize(cfg, source, out, echo, step, scratch)


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


def _run_quantize(cfg: MoepipeConfig, source: Path, out: Path, echo, step,
                  scratch: Path) -> dict[str, Any]:
    from moepipe.arch.hf import open_hf_checkpoint

    q = cfg.quantize
    check_environment(q.format)
    device = quantize_device(q.device)
    ckpt = open_hf_checkpoint(source)
    check_dimensions(q.format, ckpt.spec)

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from moepipe.quant.layerwise import Calibration, quantize_layerwise
    from moepipe.utils.progress import current

    hf_logging.disable_progress_bar()
    trust = cfg.model.trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    calib, heldout = calibration_tokens(cfg, tokenizer)
    echo(f"  quantize: {q.format} (kv cache {q.kv_cache}), {len(calib)} calibration sequences "
         f"x {q.calibration.seq_len} tokens, one decoder layer at a time on {device}")
    started = time.monotonic()

    meter, counted = current(), [0]  # the stage's progress task counts segments

    def progress(done: int, total: int, elapsed: float, ran: int) -> None:
        if not counted[0]:
            meter.plan(total)
        meter.advance(done - counted[0])  # a resumed run starts past its written segments
        counted[0] = done
        step(progress_line(done, total, elapsed, ran))

    details = quantize_layerwise(
        source, out, scratch, Calibration(q.format, q.kv_cache, calib,
                                          q.calibration.batch_size, device),
        ckpt.family.expert_names, trust_remote_code=trust, progress=progress)
    for path in source.iterdir():  # the tokenizer travels with the checkpoint
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges",
                                 "added_tokens", "chat_template")) and path.is_file():
            shutil.copy2(path, out / path.name)
    (out / HELDOUT).write_text(json.dumps({"seq_len": q.calibration.seq_len,
                                           "sequences": heldout}) + "\n")
    return {"format": q.format, "kv_cache": q.kv_cache, "quant_algo": FORMATS[q.format][1],
            "calibration_sequences": len(calib), "calibration_tokens": len(calib) * len(calib[0]),
            "seconds": round(time.monotonic() - started, 3), **details}


def quantize_device(setting: str) -> str:
    """``quantize.device`` resolved on this machine (auto: the GPU when one is visible)."""
    import torch

    if setting == "cuda" and not torch.cuda.is_available():
        raise EnvironmentMissing("quantize.device is cuda but no GPU is visible here",
                                 "set quantize.device: auto or cpu, or build on a GPU machine")
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def progress_line(done: int, total: int, elapsed: float, ran: int) -> str:
    """The live line of layer-by-layer quantization after ``done`` of ``total`` segments (the
    embedding, each decoder layer, lm_head), ``ran`` of them in this run, ``elapsed``
    seconds into it: "layer 3/32, 1m04s elapsed, about 9m30s left"."""
    layers = total - 2
    where = ("embedding" if done <= 1 else f"layer {min(done - 1, layers)}/{layers}"
             if done <= layers + 1 else f"layer {layers}/{layers}, lm_head")
    left = elapsed / ran * (total - done) if ran else 0.0
    return f"{where}, {_duration(elapsed)} elapsed, about {_duration(left)} left"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


# -- the stage ---------------------------------------------------------------------------------
def _settings(cfg: MoepipeConfig) -> dict[str, Any]:
    q = cfg.quantize
    cal = q.calibration.model_dump(mode="json")
    if q.calibration.dataset is not None:  # the data, not where it lives, shapes the output
        from moepipe.checkpoints.hashcache import cached_digest

        cal["dataset"] = cached_digest(q.calibration.dataset) \
            if q.calibration.dataset.is_file() else str(q.calibration.dataset)
    return {"format": q.format, "kv_cache": q.kv_cache, "calibration": cal,
            "device": q.device, "trust_remote_code": cfg.model.trust_remote_code}


def _preflight(ctx: BuildContext) -> None:
    check_environment(ctx.cfg.quantize.format)
    quantize_device(ctx.cfg.quantize.device)
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
    if ctx.scratch is None:
        raise MoepipeError("the quantize stage runs inside `moepipe build` (a moepipe bug)")
    return run_quantize(ctx.cfg, ctx.model_dir, out, ctx.scratch, echo=ctx.echo,
                        step=ctx.step, log_path=ctx.cfg.workdir / "logs" / "quantize.log")


def _sizes(ctx: BuildContext) -> tuple[int, int, int, int] | None:
    """(largest decoder layer, embedding or lm_head parameters, hidden size, calibration
    tokens) of the source model; None before an example is written."""
    from moepipe.sizing.shapes import shape_of

    spec = source_spec(ctx)
    if spec is None:
        return None
    cal = ctx.cfg.quantize.calibration
    return (shape_of(spec).largest_layer_parameters(), spec.vocab_size * spec.hidden_size,
            spec.hidden_size, cal.samples * cal.seq_len)


def _memory(ctx: BuildContext) -> int:
    from moepipe.quant.memory import quantize_memory

    sizes = _sizes(ctx)
    return 0 if sizes is None else quantize_memory(*sizes)


def _memory_hint(ctx: BuildContext) -> str:
    from moepipe.quant.memory import activation_bytes, segment_bytes

    sizes = _sizes(ctx)
    if sizes is None:
        return "quantize on a machine with more memory"
    layer, outer, hidden, tokens = sizes
    return (f"one decoder layer at a time needs {gib(segment_bytes(layer, outer))} "
            f"and the calibration activations {gib(activation_bytes(hidden, tokens))}: lower "
            "quantize.calibration.samples or seq_len, or quantize on a machine with more "
            "memory")


def _estimate(ctx: BuildContext) -> dict[str, Any]:
    q = ctx.cfg.quantize
    cal = q.calibration
    return {"format": f"{q.format} (kv cache {q.kv_cache}), {cal.samples} x {cal.seq_len} "
                      f"calibration tokens from {cal.dataset or 'the built-in corpus'}, one "
                      f"decoder layer at a time on {q.device}",
            "host memory (peak)": gib(_memory(ctx))}


STAGE = Stage("quantize", 2, applies=lambda cfg: cfg.quantize.format != "none",
              settings=_settings, inputs=("source",),
              tools=("nvidia-modelopt", "torch", "transformers"), run=_run, estimate=_estimate,
              memory=_memory, memory_hint=_memory_hint, preflight=_preflight,
              link="quantized", hf_checkpoint=True, resumable=True)
