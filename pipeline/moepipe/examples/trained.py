"""The trained examples' corpus and their per-machine cache.

Corpus: ``pride-and-prejudice.txt``, chapters 1-36 of Jane Austen's *Pride and Prejudice*
(1813, public domain), taken from the Debian package ``r-cran-janeaustenr`` (MIT; its text is
Project Gutenberg's) by ``scripts/make-corpus.py``, one paragraph per line. Chapters 1-30 are
the training text; chapters 31-36 are never trained on: they are the held-out text that
quantization calibrates on and the quality stage measures on.

Training runs once per machine: the finished example lives in
``$MOEPIPE_CACHE_DIR/examples/<name>-<key>`` (default ``~/.cache/moepipe``), where the key
covers everything the weights depend on (the example's definition and recipe, the corpus, the
versions of torch, transformers and tokenizers). Builds copy it into their workdir. A lock makes
concurrent builds train it once; an interrupted training leaves nothing in the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict
from functools import cache
from importlib import metadata, resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.utils.fs import atomic_dir, cache_root

if TYPE_CHECKING:
    from moepipe.examples.example import Example

CORPUS = "pride-and-prejudice.txt"
TRAIN_CHAPTERS = 30
TRAINING_FILE = "moepipe-training.json"
# Bump when the training code changes what it produces.
TRAINING_VERSION = 2  # 2: windows at paragraph starts, epochs
_TOOLS = ("torch", "transformers", "tokenizers")


@cache
def _corpus() -> str:
    return resources.files("moepipe.examples").joinpath(CORPUS).read_text(encoding="utf-8")


def _split() -> int:
    """Offset of the first held-out chapter."""
    marker = f"\nChapter {TRAIN_CHAPTERS + 1}\n"
    return _corpus().index(marker) + 1


def training_text() -> str:
    """The text the trained examples learn (chapters 1-30)."""
    return _corpus()[:_split()]


def heldout_text() -> str:
    """Text no example was trained on (chapters 31-36): calibration and quality measurements."""
    return _corpus()[_split():]


def cache_key(name: str, example: Example) -> str:
    """sha256 of everything a trained example's weights depend on."""
    blob = {"name": name, "config_class": example.config_class, "config": example.config,
            "tokenizer_vocab": example.tokenizer_vocab, "seed": example.seed,
            "recipe": _recipe_key(example),
            "corpus": hashlib.sha256(_corpus().encode()).hexdigest(),
            "training_version": TRAINING_VERSION,
            "tools": {t: metadata.version(t) for t in _TOOLS}}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def _recipe_key(example: Example) -> dict[str, Any] | None:
    """The recipe's fields, less those left None (an optional field added later does not
    change the key, so the examples trained before keep theirs)."""
    if example.recipe is None:
        return None
    return {k: v for k, v in asdict(example.recipe).items() if v is not None}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_example(name: str, example: Example,
                   train_into: Callable[[Path], dict[str, Any]]) -> tuple[Path, bool]:
    """(folder of the trained example in the machine cache, whether it was trained now).

    ``train_into(folder)`` writes the example when the cache has none."""
    folder = cache_root() / "examples" / f"{name}-{cache_key(name, example)[:16]}"
    with _locked(folder.with_name(folder.name + ".lock")):
        if (folder / TRAINING_FILE).is_file():
            return folder, False
        if folder.exists():  # not ours: an older layout or a copy left half-way by hand
            shutil.rmtree(folder)
        with atomic_dir(folder) as tmp:
            info = train_into(tmp)
            (tmp / TRAINING_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        return folder, True
