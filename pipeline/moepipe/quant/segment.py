"""One segment of the model - the embedding, one decoder layer, or the final norm with
``lm_head`` - calibrated by modelopt's ``mtq.quantize`` and exported with the steps of
modelopt's unified Hugging Face export, as the whole-model path runs them on the whole model.

* A segment lives in a :func:`holder`: a module tree that puts it under its name in the model
  (``model.layers.7``), so that every quantizer pattern of the recipe, every exported tensor and
  every ``exclude_modules`` entry is named as in the whole model; the holder's class is named
  like the model's (modelopt picks expert names by it).
* The forward loop (:class:`PassRecorder`) replays the inputs the whole model's calibration
  would feed the segment. Calibration passes activations through unquantized, so a layer's
  outputs in each pass are what the next layer receives in that pass of the whole-model
  calibration; they are kept per pass (passes that agree bit for bit are held once).
* :func:`export_segment` is modelopt 0.47's ``_export_transformers_checkpoint`` (behind
  ``export_hf_checkpoint``) step by step on the holder: prepare the MoE inputs, requantize and
  resmooth the modules that share an input (found by a forward of the segment), sync the gate/up
  amaxes, quantize the weights, post-process the state dict, revert transformers' renames.
  Nothing in it crosses a decoder layer; the tied-weight steps concern the embedding and
  ``lm_head``, which no moepipe format quantizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moepipe.quant.skeleton import Skeleton

KV_CACHE_MAX_BOUND = 448  # modelopt's unified export: KV cache scale = amax / 448


class _Holder:
    """Base of the holder classes (made per model class by :func:`holder`)."""


def holder(skeleton: Skeleton, parts: dict[str, nn.Module],
           dummy: Callable[[torch.Tensor], Any]) -> nn.Module:
    """A module tree holding ``parts`` under their names in the model. Its forward (what
    modelopt's export runs to find modules that share an input) calls ``dummy(input_ids)``."""
    from torch import nn

    def forward(self, input_ids=None, *args, **kwargs):
        return dummy(input_ids)

    def device(self):
        return next(self.parameters()).device

    cls = type(type(skeleton.model).__name__, (nn.Module, _Holder),
               {"forward": forward, "device": property(device)})
    root = cls()
    root.config = skeleton.model.config
    for name, module in parts.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, module)
    return root


class PassRecorder:
    """The forward loop of one segment's calibration: call ``k`` replays ``inputs[k]`` (the
    last one when the previous segment ran fewer passes) through ``run(batch, x)`` and keeps
    the outputs in :attr:`outputs`. With ``outputs_needed`` False (nothing comes after the
    segment), a segment with no enabled quantizer is not run at all: nothing would change."""

    def __init__(self, inputs: list[list[torch.Tensor]], run: Callable[[int, Any], Any],
                 outputs_needed: bool = True, after_pass: Callable[[], None] = lambda: None):
        self.inputs, self.run, self.outputs_needed = inputs, run, outputs_needed
        self.after_pass = after_pass
        self.outputs: list[list[torch.Tensor]] = []

    def __call__(self, model: nn.Module) -> None:
        import torch

        if not self.outputs_needed and not _enabled_quantizers(model):
            return
        batches = self.inputs[min(len(self.outputs), len(self.inputs) - 1)]
        previous = self.outputs[-1] if self.outputs else None
        outs = []
        with torch.no_grad():
            for b, x in enumerate(batches):
                y = self.run(b, x)
                y = y[0] if isinstance(y, tuple) else y
                if previous is not None and torch.equal(y, previous[b]):
                    y = previous[b]  # the same activations as the last pass: held once
                outs.append(y)
        if previous is not None and all(a is b for a, b in zip(outs, previous, strict=True)):
            outs = previous
        self.outputs.append(outs)
        self.after_pass()


def _enabled_quantizers(model: nn.Module) -> bool:
    from modelopt.torch.quantization.nn import TensorQuantizer

    return any(isinstance(m, TensorQuantizer) and m.is_enabled for m in model.modules())


class RoutedTokens:
    """Counts, per MoE block of ``layer``, the tokens its router sends each expert with the
    model's own ``top_k`` (modelopt's calibration also routes every token to every expert:
    those calls are not counted), until :meth:`stop` (after the first calibration pass)."""

    def __init__(self, layer: nn.Module, top_k: int):
        import torch

        self.counts: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, module in layer.named_modules():
            experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
            if experts is not None and gate is not None and hasattr(gate, "top_k"):
                self.counts[name] = torch.zeros(len(experts), dtype=torch.long)
                self._handles.append(gate.register_forward_hook(self._hook(name, top_k)))

    def _hook(self, name: str, top_k: int):
        import torch

        def count(module, inputs, output):
            if module.top_k == top_k and isinstance(output, tuple) and len(output) >= 3:
                self.counts[name] += torch.bincount(output[2].reshape(-1).cpu(),
                                                    minlength=len(self.counts[name]))
        return count

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def unrouted(self) -> int:
        """Experts (over the layer's MoE blocks) that were sent no token."""
        return sum(int((c == 0).sum()) for c in self.counts.values())


def export_segment(root: nn.Module, skeleton: Skeleton, extra: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any], str | None]:
    """The unified-checkpoint tensors of a calibrated segment (checkpoint names), its entries of
    modelopt's per-module quantization table (for ``hf_quant_config.json``, see
    :func:`moepipe.quant.unified.quant_config`) and the KV cache format it found.
    ``extra`` (INT8 KV scales) joins the tensors as ``export_hf_checkpoint``'s
    ``extra_state_dict`` does. Changes ``root``, as the export does."""
    from modelopt.torch.export import unified_export_hf as ue
    from modelopt.torch.export.quant_aware_conversion import (
        revert_weight_conversion_quant_aware,
    )
    from modelopt.torch.export.quant_utils import postprocess_state_dict
    from modelopt.torch.quantization.plugins.huggingface import _reconstruct_fused_moe_linear

    from moepipe.quant.recipe import exact_export, fuse_like_trtllm

    dtype = ue._resolve_export_dtype(skeleton.model, None)
    fuse_like_trtllm(root, skeleton.expert_names)
    with exact_export(), _layer_table() as table:
        ue._prepare_moe_inputs(root, dtype, False)
        ue.requantize_resmooth_fused_llm_layers(root)
        kv = ue.get_quant_config(root)["quantization"]["kv_cache_quant_algo"]
        ue._warn_on_unsynced_moe_gate_up(root)
        ue._process_quantized_modules(root, dtype, False)
        _reconstruct_fused_moe_linear(root)
    state = postprocess_state_dict(root.state_dict(), KV_CACHE_MAX_BOUND, kv, False)
    # a tied lm_head is its embedding's alias: written once, with the embedding (as the
    # whole-model export drops tied aliases)
    for alias in getattr(skeleton.model, "all_tied_weights_keys", None) or {}:
        state.pop(alias, None)
    state = revert_weight_conversion_quant_aware(skeleton.model, {**state, **extra})
    return state, table, kv


@contextlib.contextmanager
def _layer_table() -> Iterator[dict[str, Any]]:
    """What ``get_quant_config`` hands to ``process_layer_quant_config`` (module -> format and
    AWQ block size): the whole model's table is the union of its segments' tables, and the
    exclude list is summarized from the whole table once (wildcards span layers)."""
    from modelopt.torch.export import quant_utils

    table: dict[str, Any] = {}
    real = quant_utils.process_layer_quant_config

    def capture(layer_config_dict: dict[str, Any]) -> dict[str, Any]:
        table.update(layer_config_dict)
        return real(layer_config_dict)

    quant_utils.process_layer_quant_config = capture
    try:
        yield table
    finally:
        quant_utils.process_layer_quant_config = real
