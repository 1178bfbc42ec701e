"""Training of the built-in *trained* examples: a tiny MoE learns the shipped corpus on CPU.

Plain next-token cross-entropy plus the family's usual load-balancing auxiliary loss
(``aux_loss_coef`` x Switch-style ``E * sum_i f_i * P_i``, computed by ``transformers`` from the
router logits, or by :mod:`moepipe.examples.routing` from the experts chosen where transformers
has none: DeepSeek; DeepSeek-V3 balances with its correction-bias rule instead), AdamW with
warm-up and cosine decay, a fixed number of steps.

Deterministic: the weights are initialised and the batches drawn from fixed seeds, torch runs
with a pinned thread count and ``torch.use_deterministic_algorithms(True)``, so the same
example gives byte-identical weights on the same torch version and CPU kind. Different CPUs
(another instruction set, another BLAS kernel) may round differently: the weights then differ
in the last bits, never in what the example is.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from moepipe.errors import MoepipeError
from moepipe.examples.routing import RouterTap
from moepipe.utils.progress import task


@dataclass(frozen=True)
class Recipe:
    """How a trained example is trained (part of its cache key)."""

    steps: int = 450
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 5e-3
    warmup: int = 30
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    aux_loss_coef: float = 0.01
    # DeepSeek-V3's auxiliary-loss-free balancing (moepipe.examples.routing); None: not used.
    # Fields that are None are left out of the cache key (existing examples keep theirs).
    bias_update_rate: float | None = None
    threads: int = 2  # pinned: the result must not depend on the machine's core count
    # Training windows begin at paragraph starts (and every seq_len // 2 tokens inside a long
    # paragraph, so no text is left out); each epoch visits all of them in a seeded order.
    window_stride: int = 64


@contextlib.contextmanager
def deterministic_torch(threads: int) -> Iterator[None]:
    """Pinned threads and deterministic algorithms for the block; restored afterwards."""
    import torch

    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


def learning_rate(recipe: Recipe, step: int) -> float:
    """Linear warm-up, then cosine decay to ``final_lr_ratio`` of the peak."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    done = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    low = recipe.final_lr_ratio
    return recipe.lr * (low + (1 - low) * 0.5 * (1 + math.cos(math.pi * done)))


def window_starts(paragraphs: list[int], length: int, recipe: Recipe) -> list[int]:
    """Token offsets where training windows begin: every paragraph start (a prompt begins a
    paragraph too) and every ``window_stride`` tokens inside a paragraph, clipped so that a
    whole window of ``seq_len + 1`` tokens fits in ``length``."""
    last = length - recipe.seq_len - 1
    starts: set[int] = set()
    for begin, end in zip(paragraphs, [*paragraphs[1:], length], strict=True):
        starts.update(min(s, last) for s in range(begin, end, recipe.window_stride))
    return sorted(starts)


def _batches(starts: list[int], recipe: Recipe, gen) -> Iterator[Any]:
    """Window starts, ``batch_size`` at a time: epochs over all starts, each in a seeded order."""
    import torch

    table = torch.tensor(starts, dtype=torch.long)
    order = table[torch.randperm(len(table), generator=gen)]
    used = 0
    while True:
        if used + recipe.batch_size > len(order):
            order = torch.cat([order[used:], table[torch.randperm(len(table), generator=gen)]])
            used = 0
        yield order[used:used + recipe.batch_size, None]
        used += recipe.batch_size


def train(model, token_ids: list[int], recipe: Recipe, seed: int,
          progress: Callable[[str], None] = lambda text: None,
          paragraphs: list[int] | None = None) -> dict[str, Any]:
    """Train ``model`` (a transformers MoE causal LM, float32) in place on ``token_ids``
    (``paragraphs``: token offsets where paragraphs begin; default: the first token only).

    Returns the first and last losses (language-model part and auxiliary part)."""
    import torch

    if len(token_ids) <= recipe.seq_len + 1:
        raise MoepipeError(f"the training text has {len(token_ids)} tokens, fewer than one "
                           f"sequence of {recipe.seq_len}", "ship a longer corpus")
    ids = torch.tensor(token_ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    batches = _batches(window_starts(paragraphs or [0], len(token_ids), recipe), recipe, gen)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=recipe.lr, betas=(0.9, 0.95), foreach=False)
    offsets = torch.arange(recipe.seq_len + 1)
    history = []
    model.train()
    with RouterTap(model) as tap, task("train", recipe.steps, "steps") as steps:
        for step in range(recipe.steps):
            history.append(_step(model, opt, tap, ids[next(batches) + offsets], recipe, step))
            steps.advance()
            if step % 10 == 0 or step == recipe.steps - 1:
                steps.say(f"loss {history[-1][0]:.3f}")
                progress(f"step {step + 1}/{recipe.steps}: loss {history[-1][0]:.3f}, "
                         f"balance loss {history[-1][1]:.3f}")
    model.eval()
    first, last = history[0], history[-1]
    return {"steps": recipe.steps, "tokens": recipe.steps * recipe.batch_size * recipe.seq_len,
            "loss_first": round(first[0], 4), "loss_last": round(last[0], 4),
            "aux_loss_first": round(first[1], 4), "aux_loss_last": round(last[1], 4)}


def _step(model, opt, tap: RouterTap, batch, recipe: Recipe, step: int) -> tuple[float, float]:
    """One optimizer step; returns (language-model loss, balance loss)."""
    import torch

    for group in opt.param_groups:
        group["lr"] = learning_rate(recipe, step)
    tap.clear()
    out = model(input_ids=batch[:, :-1], output_router_logits=True)
    lm = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    # transformers' own loss where the family has one (Mixtral, Qwen, OLMoE, GPT-OSS), else
    # the same formula over the experts the routers chose (DeepSeek)
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        aux = tap.aux_loss()
    loss = lm + recipe.aux_loss_coef * aux
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if recipe.bias_update_rate is not None:
        tap.update_correction_bias(recipe.bias_update_rate)
    return lm.item(), aux.item()

