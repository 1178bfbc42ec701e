"""What a build stage is, and what it sees while it runs.

A :class:`Stage` is data: its name, what shapes its output (settings, inputs, tool versions),
how it runs, and the optional hooks the runner (:mod:`moepipe.commands.build`) calls - a
pre-flight check, a memory estimate, a gate on its results. Each stage module declares its own
``STAGE``; :mod:`moepipe.stages.registry` lists them in order. The runner knows no stage by name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moepipe.config import MoepipeConfig
from moepipe.targets import get_target

Echo = Callable[[str], None]
log = logging.getLogger("moepipe")


def fault_point(point: str) -> None:
    """Test hook for the kill tests: ``MOEPIPE_FAULT=<stage>`` kills the build (SIGKILL) when
    that stage's output is complete but not yet renamed into place (the last moment a kill can
    hit it); ``MOEPIPE_FAULT=<stage>@<n>`` at the stage's n-th progress step."""
    if os.environ.get("MOEPIPE_FAULT") == point:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class BuildContext:
    """The config, and the outputs of the stages that ran (or were reused) so far, in order."""

    cfg: MoepipeConfig
    echo: Echo
    outputs: dict[str, Path] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)
    details: dict[str, dict] = field(default_factory=dict)
    status: Echo = field(default=lambda text: None)  # the live progress line of the stage
    stage: str = ""  # the stage running now
    steps: int = 0
    # stage name -> True when its output is a Hugging Face checkpoint later stages read
    hf_outputs: dict[str, bool] = field(default_factory=dict)
    # A resumable stage's folder for finished work that outlives a killed build (see Stage).
    scratch: Path | None = None

    def step(self, text: str) -> None:
        """Progress inside a stage (a shard, a layer, a batch): the live line on a terminal,
        a log record (``-v``) otherwise."""
        log.info("%s", text)
        self.status(text)
        self.steps += 1
        fault_point(f"{self.stage}@{self.steps}")

    def output(self, stage: str) -> Path:
        return self.outputs[stage]

    def add(self, stage: Stage, path: Path) -> None:
        """Record ``stage``'s output (in build order)."""
        self.outputs[stage.name] = path
        self.hf_outputs[stage.name] = stage.hf_checkpoint

    @property
    def source_dir(self) -> Path | None:
        """The first Hugging Face checkpoint of the build (the user's model or the example)."""
        return next((self.outputs[n] for n, hf in self.hf_outputs.items() if hf), None)

    @property
    def latest_hf_checkpoint(self) -> Path | None:
        """The latest Hugging Face checkpoint of the build (quantized when the config asks for
        it); None while no stage has produced one (a plan made before the build runs)."""
        latest = [self.outputs[n] for n, hf in self.hf_outputs.items() if hf]
        return latest[-1] if latest else None

    @property
    def model_dir(self) -> Path:
        """The Hugging Face checkpoint the model stages read (:attr:`latest_hf_checkpoint`,
        which the source stage always produces before them)."""
        latest = self.latest_hf_checkpoint
        if latest is None:
            raise RuntimeError("no stage has produced a Hugging Face checkpoint yet")  # a bug
        return latest


@dataclass(frozen=True)
class Stage:
    name: str
    version: int
    # Within a target that lists the stage (moepipe.targets: Target.stages), whether the
    # config needs it (quantize: only for a quantized model).
    applies: Callable[[MoepipeConfig], bool]
    settings: Callable[[MoepipeConfig], dict[str, Any]]  # config values its output depends on
    inputs: tuple[str, ...]  # stages it reads (their fingerprints are part of its own)
    tools: tuple[str, ...]  # distributions whose versions shape its output
    run: Callable[[BuildContext, Path], dict[str, Any]]  # writes into the given folder
    estimate: Callable[[BuildContext], dict[str, Any]] | None = None  # plan: memory, command
    memory: Callable[[BuildContext], int] | None = None  # peak host bytes (pre-flight)
    # What to change when the machine has too little memory (may depend on the config).
    memory_hint: str | Callable[[BuildContext], str] = "use a machine with more memory"
    disk: Callable[[BuildContext], int] | None = None  # bytes its output takes (pre-flight)
    # Checks of the machine and the config made before the build runs any stage (fail fast).
    preflight: Callable[[BuildContext], None] | None = None
    # Gates on a finished stage's details, applied whenever a build or deploy reads it.
    check: Callable[[MoepipeConfig, dict[str, Any]], None] | None = None
    # The name of the link to its output in the workdir (``<workdir>/<link>``), if any.
    link: str | None = None
    # Its output is a Hugging Face checkpoint (the model later stages read).
    hf_checkpoint: bool = False
    # It runs only on a GPU machine (a GPU target's deployment renders before it ran).
    gpu: bool = False
    # A folder of the user's used in place instead of an output (None: build one).
    in_place: Callable[[MoepipeConfig], Path | None] | None = None
    # Extra fingerprint inputs read from outside the config (e.g. the BLAKE3 of the user's files).
    external: Callable[[MoepipeConfig], dict[str, Any]] | None = None
    # Resumable: the runner gives it ``ctx.scratch``, a folder kept when a build is killed
    # (``.<output>.resume`` beside the output, so for its fingerprint only) and removed once
    # the stage's output is in place. What the stage keeps there must be complete when named.
    resumable: bool = False

    def needed(self, cfg: MoepipeConfig) -> bool:
        """Whether a build of ``cfg`` runs this stage: its target's deployment is made from
        it and the config asks for it."""
        return self.name in get_target(cfg.target).stages and self.applies(cfg)


def gib(n: int) -> str:
    """Bytes as GiB for plans and messages."""
    return f"{n / 2**30:.2f} GiB"
