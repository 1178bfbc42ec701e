"""Layer-by-layer quantization: modelopt's calibration and unified export, one piece of the
model at a time, so that memory is bounded by a decoder layer and the calibration activations,
whatever the depth of the model.

The model is cut into segments - what comes before the decoder layers (the embedding), each
decoder layer, what comes after them (final norm, ``lm_head``). Each is materialized from the
checkpoint (:mod:`moepipe.quant.skeleton`), quantized by ``mtq.quantize`` with the activations
the whole-model calibration would feed it, exported (:mod:`moepipe.quant.segment`) and written
as its own shard; then it is freed. The result is the unified checkpoint the whole-model path
writes (``tests/e2e/test_layerwise_equivalence.py`` compares them tensor by tensor).

Resuming: ``scratch`` (kept by the build across a kill) holds each finished segment's shard, the
inputs of the next segment and ``state.json``, each made complete under a temporary name and
renamed. A rerun continues at the first unfinished segment; shards reach ``out`` (the stage's
output, itself renamed into place when complete) only when every segment is done.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moepipe.quant.skeleton import Skeleton


@dataclass(frozen=True)
class Calibration:
    fmt: str
    kv_cache: str
    sequences: list[list[int]]
    batch_size: int
    device: str  # "cpu" or "cuda"

    def batches(self) -> list[list[list[int]]]:
        bs = self.batch_size
        return [self.sequences[i:i + bs] for i in range(0, len(self.sequences), bs)]

    def key(self, source: Path) -> str:
        """What a resumed run must share with the run it continues."""
        blob = json.dumps([self.fmt, self.kv_cache, self.sequences, self.batch_size,
                           self.device, (source / "config.json").read_text()])
        return hashlib.sha256(blob.encode()).hexdigest()


# (segments done, segments in all, seconds since this run started, segments this run did)
Progress = Callable[[int, int, float, int], None]


def quantize_layerwise(source: Path, out: Path, scratch: Path, cal: Calibration,
                       expert_names: tuple[str, str, str], trust_remote_code: bool = False,
                       progress: Progress = lambda *a: None) -> dict[str, Any]:
    """Quantize the checkpoint at ``source`` into ``out`` (shards, index, configs; the caller
    adds the tokenizer). Returns what the stage records."""
    import torch
    from modelopt.torch.quantization.plugins.huggingface import register_hf_attentions_on_the_fly

    from moepipe.quant.recipe import mark_int8_kv
    from moepipe.quant.scratch import Scratch
    from moepipe.quant.skeleton import open_skeleton
    from moepipe.quant.unified import quant_config, write_configs, write_index

    started = time.monotonic()
    skeleton = open_skeleton(source, expert_names, trust_remote_code)
    register_hf_attentions_on_the_fly(skeleton.model)  # KV cache quantizers: needs the model
    n_layers = skeleton.num_layers
    total = n_layers + 2  # before the layers (embedding), the layers, after them (lm_head)
    before, after = _outer(skeleton)
    state = Scratch.open(scratch, cal.key(source), total)
    resumed_at = state.done or None
    for name, module in before:
        skeleton.materialize(module, name, cal.device)
    batches = cal.batches()
    # the layers' keyword arguments; modelopt's export probes with token ids of shape [1, 2]
    records = list(skeleton.layer_inputs(batches + [[[1, 1]]], cal.device))
    kwargs = [kw for _, kw in records]
    passes = [[h.cpu() for h, _ in records[:-1]]] if state.done <= 1 else state.activations()
    del records
    if state.done:
        _free(before)
    ids = [torch.tensor(b) for b in batches]
    calibrated = 0
    for seg in range(state.done, total):
        t0 = time.monotonic()
        outputs = None
        if seg == 0:
            record, tensors, _ = _segment(skeleton, cal, dict(before), [ids], _chain(before))
        elif seg <= n_layers:
            record, tensors, outputs = _layer(skeleton, cal, seg - 1, passes, kwargs)
        else:
            record, tensors, _ = _segment(skeleton, cal, _materialized(skeleton, after, cal),
                                          passes, _chain(after))
        if seg == 0:
            _free(before)  # the layers' inputs are known
        record["seconds"] = round(time.monotonic() - t0, 3)
        state.finish(seg, record, tensors, outputs)
        del tensors
        if outputs is not None:
            passes = outputs
        calibrated += 1
        gc.collect()
        progress(seg + 1, total, time.monotonic() - started, calibrated)
    del passes, kwargs
    table, kv = _table(state.records)
    weight_map = state.move_shards(out)
    write_index(out, weight_map, sum(r["bytes"] for r in state.records))
    write_configs(skeleton, source, out, quant_config(skeleton, table, kv), _export_dtype(source))
    if cal.kv_cache == "int8":
        mark_int8_kv(out)
    state.clear()
    layers = state.records[1:1 + n_layers]
    seconds = sum(r["seconds"] for r in layers)
    tokens = sum(len(s) for s in cal.sequences)
    return {"device": cal.device, "layers": n_layers, "shards": total,
            "resumed_at_segment": resumed_at,
            "quantized_modules": sum(r["quantized"] for r in state.records),
            "unrouted_experts": [r["unrouted"] for r in layers],
            "layer_seconds": [r["seconds"] for r in layers],
            "calibration_tokens_per_s": round(tokens * n_layers / seconds, 1) if seconds else None}


def _outer(skeleton: Skeleton) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """The modules with checkpoint tensors before and after the decoder layers."""
    from moepipe.errors import UnsupportedError

    if any(True for _ in skeleton.model.parameters(recurse=False)):
        raise UnsupportedError(f"{type(skeleton.model).__name__} holds weights outside its "
                               "modules; layer-by-layer quantization cannot place them",
                               "this architecture is not quantized by moepipe")
    names = [n for n, _ in skeleton.model.named_modules()]
    where = names.index(skeleton.prefix)
    outer = skeleton.outer_modules()
    return ([(n, m) for n, m in outer if names.index(n) < where],
            [(n, m) for n, m in outer if names.index(n) > where])


def _free(parts: list[tuple[str, nn.Module]]) -> None:
    for _, module in parts:
        module.to("meta")


def _materialized(skeleton: Skeleton, parts: list[tuple[str, nn.Module]],
                  cal: Calibration) -> dict[str, nn.Module]:
    return {name: skeleton.materialize(module, name, cal.device) for name, module in parts}


def _chain(parts: list[tuple[str, nn.Module]]) -> Callable[[int, Any], Any]:
    """The modules applied one after the other (the embedding; final norm then lm_head)."""
    def run(batch: int, x: Any) -> Any:
        for _, module in parts:
            x = module(x.to(next(module.parameters()).device))
        return x
    return run


def _table(records: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """The whole model's per-module quantization table and KV cache format."""
    table: dict[str, Any] = {}
    kv = None
    for r in records:
        table.update(r["table"])
        kv = kv or r["kv"]
    return table, kv


def _layer(skeleton: Skeleton, cal: Calibration, index: int,
           passes: list[list[torch.Tensor]], kwargs: list[list[dict[str, Any]]]
           ) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """Decoder layer ``index``: its record, tensors and outputs per calibration pass."""
    import torch

    from moepipe.quant.segment import RoutedTokens

    name = skeleton.layer_name(index)
    layer = skeleton.materialize(skeleton.decoder_layer(index), name, cal.device)
    on_device: dict[int, Any] = {}

    def run(batch: int, x: torch.Tensor) -> torch.Tensor:
        kw = {k: _to(v, cal.device, on_device) for k, v in kwargs[batch][index].items()}
        y = layer(x.to(cal.device), **kw)
        return (y[0] if isinstance(y, tuple) else y).cpu()

    def probe(input_ids: torch.Tensor) -> Any:
        """The export's forward that finds the modules sharing an input (values are not used:
        the layer's own dtype, as in the whole model after its cast)."""
        device, dtype = input_ids.device, next(layer.parameters()).dtype
        x = torch.ones((*input_ids.shape, skeleton.model.config.hidden_size), device=device,
                       dtype=dtype)
        return layer(x, **{k: _to(v, device, {}, dtype) for k, v in kwargs[-1][index].items()})

    routed = RoutedTokens(layer, int(getattr(skeleton.model.config, "num_experts_per_tok", 0)))
    record, tensors, outputs = _segment(skeleton, cal, {name: layer}, passes, run,
                                        is_layer=True, probe=probe, after_pass=routed.stop)
    record["unrouted"] = routed.unrouted() if routed.counts else None
    return record, tensors, outputs


def _segment(skeleton: Skeleton, cal: Calibration, parts: dict[str, nn.Module],
             inputs: list[list[Any]], run: Callable[[int, Any], Any],
             is_layer: bool = False, probe: Callable[[Any], Any] = lambda ids: None,
             after_pass: Callable[[], None] = lambda: None
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """Calibrate and export one segment (a decoder layer, or what comes before or after them):
    its record, its tensors (checkpoint names) and its outputs per calibration pass."""
    from modelopt.torch.quantization import quantize as mtq_quantize

    from moepipe.errors import MoepipeError
    from moepipe.quant.recipe import inspect_quantizers, int8_kv_scales, quant_config
    from moepipe.quant.segment import PassRecorder, export_segment, holder

    recorder = PassRecorder(inputs, run, is_layer, after_pass)
    root = holder(skeleton, parts, probe)
    with _no_weights_expected(not is_layer):
        mtq_quantize(root, quant_config(cal.fmt, cal.kv_cache), recorder)
    quantized, never = inspect_quantizers(root)
    if never:
        raise MoepipeError(f"router / gate modules were quantized: {', '.join(never[:3])} "
                           "(a moepipe bug)")
    extra = int8_kv_scales(root) if cal.kv_cache == "int8" else {}
    dtype = _cast_dtype(skeleton)
    if dtype is not None:  # calibrated in float32, kept 16-bit (as the whole-model path does)
        root.to(dtype)
    tensors, table, kv = export_segment(root.cpu(), skeleton, extra)
    record = {"table": table, "kv": kv, "quantized": quantized, "unrouted": None}
    return record, tensors, recorder.outputs


@contextlib.contextmanager
def _no_weights_expected(skip: bool) -> Iterator[None]:
    """modelopt refuses a model in which no weight gets quantized; the embedding and lm_head
    legitimately have none (a pipeline stage without quantized modules, in modelopt's words:
    its documented switch, set only around them)."""
    from modelopt.torch.quantization.model_quant import _SKIP_WEIGHT_QUANT_CHECK_ENV as env

    saved = os.environ.get(env)
    if skip:
        os.environ[env] = "1"
    try:
        yield
    finally:
        if skip:
            if saved is None:
                del os.environ[env]
            else:
                os.environ[env] = saved


def _to(value: Any, device: Any, cache: dict[int, Any], dtype: Any = None) -> Any:
    """``value`` with its tensors on ``device`` (each moved once per ``cache``), floating ones
    cast to ``dtype`` if given."""
    import torch

    if isinstance(value, torch.Tensor):
        if id(value) not in cache:
            cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
            cache[id(value)] = value.to(device, cast)
        return cache[id(value)]
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device, cache, dtype) for v in value)
    return value


def _source_dtype(source: Path) -> str:
    config = json.loads((source / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _export_dtype(source: Path) -> str:
    """The dtype the exported weights keep: the checkpoint's when it is 16-bit."""
    dtype = _source_dtype(source)
    return dtype if dtype in ("float16", "bfloat16") else "float32"


def _cast_dtype(skeleton: Skeleton) -> torch.dtype | None:
    import torch

    name = _source_dtype(skeleton.reader.folder)
    return getattr(torch, name) if name in ("float16", "bfloat16") else None
