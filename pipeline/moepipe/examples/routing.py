"""What the routers of a training model chose: a tap on transformers' MoE routers.

Every MoE family of transformers routes with a ``*TopKRouter`` module that returns
``(router_logits, weights, expert_indices)``; the indices are the experts really chosen (after
DeepSeek's group limit and correction bias, which a top-k of the logits would miss). The tap
keeps them for one forward pass so that training can

* compute the Switch-style load-balancing loss where transformers returns none (DeepSeek-V2:
  the expert-level balance loss of its paper, ``E * sum_i f_i * P_i``, the formula of
  transformers' ``load_balancing_loss_func`` with the experts actually chosen), and
* apply DeepSeek-V3's auxiliary-loss-free balancing (its paper, section 2.1.2): after each step
  every router's ``e_score_correction_bias`` rises by ``rate`` for an expert that got fewer
  than the mean number of tokens and falls by ``rate`` for one that got more (transformers
  keeps the bias as a buffer and never updates it).
"""

from __future__ import annotations

from typing import Any


def routers(model) -> list[Any]:
    """The router modules of ``model``, in layer order (dense layers have none)."""
    found = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    if not found:
        from moepipe.errors import MoepipeError

        raise MoepipeError(f"{type(model).__name__} has no top-k router module",
                           "this family cannot be a trained example yet")
    return found


class RouterTap:
    """Forward hooks on every router; ``calls`` holds (router, logits, indices) of the passes
    since the last ``clear()``. Use as a context manager (the hooks are removed on exit)."""

    def __init__(self, model) -> None:
        self.routers = routers(model)
        self.calls: list[tuple[Any, Any, Any]] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> RouterTap:
        for router in self.routers:
            self._hooks.append(router.register_forward_hook(self._record))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.calls.clear()

    def _record(self, module, args, output) -> None:
        self.calls.append((module, output[0], output[2]))

    def clear(self) -> None:
        self.calls.clear()

    def aux_loss(self):
        """Switch-style balance loss over all layers' tokens: ``E * sum_k,i f_k,i * P_i``
        (``f``: share of the k-th choices that went to expert i; ``P``: mean softmax
        probability of expert i); ``top_k`` when perfectly even."""
        import torch

        logits = torch.cat([c[1] for c in self.calls])
        indices = torch.cat([c[2] for c in self.calls])
        experts = logits.shape[-1]
        share = torch.nn.functional.one_hot(indices, experts).float().mean(0)  # (top_k, E)
        prob = logits.float().softmax(-1).mean(0)
        return experts * (share * prob[None]).sum()

    def update_correction_bias(self, rate: float) -> None:
        """DeepSeek-V3's bias rule, one step: ``b_i += rate * sign(mean load - load_i)``."""
        import torch

        with torch.no_grad():
            for module, logits, indices in self.calls:
                load = torch.bincount(indices.flatten(), minlength=logits.shape[-1]).float()
                module.e_score_correction_bias += rate * torch.sign(load.mean() - load)
