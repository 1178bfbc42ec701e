"""What a built-in example is: a transformers config class and its values, a seed, and the
training recipe of a trained example (the registry, ``EXAMPLES``, is :mod:`moepipe.examples`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moepipe.examples.train import Recipe


@dataclass(frozen=True)
class Example:
    config_class: str  # transformers config class
    description: str
    config: dict[str, Any]
    tokenizer_vocab: int = 512
    seed: int = 1234
    extra: dict[str, Any] = field(default_factory=dict)
    recipe: Recipe | None = None  # trained on the shipped corpus when set

    @property
    def trained(self) -> bool:
        return self.recipe is not None
