"""The model as layer-by-layer quantization sees it: transformers' own module tree on the meta
device (no memory), whose pieces are materialized one at a time from the checkpoint with
moepipe's streaming reader, in float32 as the whole-model calibration loads them.

* The tree comes from ``AutoModelForCausalLM.from_config`` (the class ``from_pretrained``
  builds); its decoder layers are found by modelopt's own discovery (the one its layerwise
  calibration uses).
* A tensor's checkpoint name is its in-memory name through modelopt's reverse name mapper (the
  same renames the unified export writes back: Mixtral's ``mlp`` is ``block_sparse_moe`` on
  disk); routed experts are :class:`~moepipe.quant.unfuse.UnfusedExperts` with the checkpoint's
  own per-expert names, as the whole-model path has them after unfusing.
* :meth:`Skeleton.layer_inputs` runs the model's own forward up to the decoder layers (the
  embedding, the attention masks, the rotary embedding) with every layer replaced by a recorder:
  the first layer's hidden states and the keyword arguments each layer is called with. Like
  modelopt's layerwise calibration, this assumes the model does nothing to the hidden state
  between decoder layers (true of every transformers decoder moepipe quantizes).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.checkpoints.reader import CheckpointReader
from moepipe.errors import CheckpointError, UnsupportedError

if TYPE_CHECKING:
    import torch
    from torch import nn

# Per batch: (hidden states entering the first layer, keyword arguments of every layer).
Batch = tuple["torch.Tensor", list[dict[str, Any]]]


class _Stop(Exception):
    """Raised by the last recorder: nothing after the decoder layers is needed."""


@dataclass
class Skeleton:
    model: Any  # the transformers model (PreTrainedModel), every tensor on the meta device
    layers: nn.ModuleList  # its decoder layers (meta)
    prefix: str  # their name in the model ("model.layers")
    hub_name: Callable[[str], str]  # in-memory tensor name -> checkpoint name
    reader: CheckpointReader
    expert_names: tuple[str, str, str]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_name(self, index: int) -> str:
        return f"{self.prefix}.{index}"

    def outer_modules(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of the leaf-most modules outside the decoder layers that hold
        tensors in the checkpoint (embedding, final norm, lm_head), in model order."""
        found = []
        for name, module in self.model.named_modules():
            if name == self.prefix or name.startswith(self.prefix + ".") or not name:
                continue
            if any(True for _ in module.parameters(recurse=False)) or \
                    any(n not in module._non_persistent_buffers_set
                        for n, _ in module.named_buffers(recurse=False)):
                found.append((name, module))
        return found

    def materialize(self, module: nn.Module, name: str, device: str = "cpu") -> nn.Module:
        """Give ``module`` (the in-memory module called ``name``) its checkpoint tensors, in the
        dtype the meta tree declares (float32). Returns the module, on ``device``."""
        import torch

        state = {}
        for key, meta in module.state_dict(keep_vars=True).items():
            full = f"{name}.{key}" if name else key
            tensor = self.read(full)
            if tuple(tensor.shape) != tuple(meta.shape):
                raise CheckpointError(f"{self.reader.folder}: {self.hub_name(full)} has shape "
                                      f"{list(tensor.shape)}, the config says "
                                      f"{list(meta.shape)}", "the checkpoint does not match "
                                      "its config.json")
            # one tensor at a time onto the device: a GPU's host holds no whole layer
            state[key] = tensor.to(device, meta.dtype if meta.is_floating_point() else None)
        with torch.no_grad():
            module.load_state_dict(state, strict=True, assign=True)
        left = [n for n, t in _tensors(module) if t.is_meta]
        if left:
            raise UnsupportedError(f"layer-by-layer quantization cannot materialize {name}."
                                   f"{left[0]} (not in the checkpoint)",
                                   "this architecture is not quantized by moepipe")
        return module

    def read(self, full: str) -> torch.Tensor:
        """The checkpoint tensor of the in-memory tensor ``full`` (a tied alias reads its
        source, as transformers ties them)."""
        hub = self.hub_name(full)
        if not self.reader.has(hub):
            tied = getattr(self.model, "all_tied_weights_keys", None) or {}
            if full in tied:
                return self.read(tied[full])
        return self.reader.read(hub)

    def decoder_layer(self, index: int) -> nn.Module:
        """A float32 copy of decoder layer ``index`` with its routed experts unfused (still
        on the meta device until :meth:`materialize`)."""
        import torch

        from moepipe.quant.unfuse import UnfusedExperts

        layer = copy.deepcopy(self.layers[index])
        for module in list(layer.modules()):
            experts = getattr(module, "experts", None)
            if experts is not None and isinstance(getattr(experts, "gate_up_proj", None),
                                                  torch.Tensor):
                with torch.device("meta"):
                    module.experts = UnfusedExperts.like(experts, self.expert_names)
        return layer.eval()

    def layer_inputs(self, batches: list[list[list[int]]], device: str) -> Iterator[Batch]:
        """For each batch of token ids: the hidden states the model feeds its first decoder
        layer, and the keyword arguments it passes each layer (tensors shared between batches
        when equal, so that a mask is held once)."""
        import torch

        model = self.model
        shared: list[torch.Tensor] = []
        saved = list(self.layers)
        try:
            for batch in batches:
                records: list[tuple[Any, dict[str, Any]]] = []
                for i in range(len(self.layers)):
                    self.layers[i] = _recorder(records, last=i == len(self.layers) - 1)
                with torch.no_grad():
                    try:
                        model(input_ids=torch.tensor(batch, device=device))
                    except _Stop:
                        pass
                hidden = records[0][0]
                yield hidden, [_share(_no_cache(kwargs), shared) for _, kwargs in records]
        finally:
            for i, layer in enumerate(saved):
                self.layers[i] = layer


def open_skeleton(source: Path, expert_names: tuple[str, str, str],
                  trust_remote_code: bool = False) -> Skeleton:
    """The model of the checkpoint at ``source`` on the meta device, ready to be materialized
    piece by piece."""
    import modelopt.torch.quantization  # noqa: F401 - registers modelopt's decoder discovery
    import torch
    from modelopt.torch.export.quant_aware_conversion import build_reverse_name_mapper
    from modelopt.torch.quantization.utils.layerwise_calib import LayerActivationCollector
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    model.eval()
    layers = LayerActivationCollector.get_decoder_layers(model)
    if not layers:
        raise UnsupportedError(f"{type(model).__name__}: modelopt finds no decoder layers to "
                               "quantize one at a time", "this architecture is not quantized "
                                                        "by moepipe")
    prefix = next(n for n, m in model.named_modules() if m is layers)
    mapper = build_reverse_name_mapper(model) or (lambda name: name)
    skeleton = Skeleton(model, layers, prefix, mapper, CheckpointReader(source), expert_names)
    _rebuild_computed_buffers(skeleton)
    return skeleton


def _rebuild_computed_buffers(skeleton: Skeleton) -> None:
    """Modules outside the layers whose buffers are computed, not stored (the rotary
    embedding's ``inv_freq``), are built again for real, from the config."""
    import torch

    model = skeleton.model
    for name, module in list(model.named_modules()):
        if name.startswith(skeleton.prefix) or not name:
            continue
        computed = [n for n, b in module.named_buffers(recurse=False)
                    if b.is_meta and n in module._non_persistent_buffers_set]
        if computed:
            with torch.device("cpu"):
                rebuilt = type(module)(config=model.config)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, rebuilt)


def _recorder(records: list, last: bool) -> nn.Module:
    """A stand-in for a decoder layer: records what it is called with, returns the hidden
    state unchanged (the last one stops the forward)."""
    from torch import nn

    class Recorder(nn.Module):
        def forward(self, hidden_states, *args, **kwargs):
            return _record(records, last, hidden_states, args, kwargs)

    return Recorder()


def _record(records: list, last: bool, hidden_states, args, kwargs):
    if args:
        raise UnsupportedError("the model passes positional arguments to its decoder layers; "
                               "layer-by-layer quantization cannot replay them",
                               "this architecture is not quantized by moepipe")
    records.append((hidden_states, kwargs))
    if last:
        raise _Stop
    return hidden_states


def _no_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Calibration replays a layer: a KV cache object would grow with every replay (the
    layer's output without one is the same)."""
    from transformers.cache_utils import Cache

    return {k: None if isinstance(v, Cache) else v for k, v in kwargs.items()}


def _share(value: Any, shared: list) -> Any:
    """``value`` with each tensor replaced by an equal one seen before, if any."""
    import torch

    if isinstance(value, dict):
        return {k: _share(v, shared) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_share(v, shared) for v in value)
    if isinstance(value, torch.Tensor):
        for seen in shared:
            if seen is value or (seen.shape == value.shape and seen.dtype == value.dtype
                                 and torch.equal(seen, value)):
                return seen
        shared.append(value)
    return value


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()
