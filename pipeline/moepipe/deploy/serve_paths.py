"""Where the rendered deployment's files are when it is served, rather than where it was built.

A deployment is served from another place than the build's: the project folder moved, copied
to another host, a Kubernetes volume mounted at ``/models``. So nothing rendered names a path
of the build machine:

- Python models (pre/postprocessing, BLS, the cpu and trtllm-pytorch ``tensorrt_llm``) get
  paths relative to their own model folder, which the Python backend passes them as
  ``args["model_repository"]`` (``serving_core.triton.model_path`` joins the two). Both ends
  must move together: the path is relative while the file and the model folder both lie in the
  deployment folder or both in the workdir.
- What needs an absolute path (the tensorrtllm backend's ``gpt_model_path`` and
  ``tokenizer_dir``, launch.sh, the pods' ``--model-repository``) is rendered under
  ``deploy.serve_root``: where the workdir is when served (default: the workdir itself, which
  is the build's own place). The Kubernetes pods mount the workdir's volume there.

A file outside the workdir (a user's checkpoint served in place) cannot move with it: with the
default serve root its own path is kept; with another serve root it is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from moepipe.errors import ConfigError

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@dataclass(frozen=True)
class ServePaths:
    """Build-machine paths -> the paths the served deployment reads."""

    workdir: Path  # the build's workdir (resolved)
    deploy_dir: Path  # the deployment folder as the build writes it (resolved)
    serve_root: PurePosixPath  # where ``workdir`` is when served

    @classmethod
    def of(cls, cfg: MoepipeConfig) -> ServePaths:
        """The paths of ``cfg``'s deployment: rendered at ``cfg.deploy_dir``, served with the
        workdir at ``deploy.serve_root`` (unset: where it is now)."""
        work = cfg.workdir.resolve()
        return cls(work, cfg.deploy_dir.resolve(), PurePosixPath(cfg.deploy.serve_root or work))

    @property
    def relocated(self) -> bool:
        """Is the workdir served somewhere else than where it was built?"""
        return self.serve_root != PurePosixPath(self.workdir)

    def absolute(self, path: Path, what: str) -> str:
        """``path`` (on the build machine) as the served deployment finds it."""
        path = path.resolve()
        if _inside(path, self.workdir):
            rel = path.relative_to(self.workdir)
            return str(self.serve_root / rel.as_posix()) if rel.parts else str(self.serve_root)
        if not self.relocated:
            return str(path)
        raise ConfigError(f"{what} {path} is outside the workdir {self.workdir}, so it is not "
                          f"at deploy.serve_root {self.serve_root} when served",
                          "keep what the deployment serves inside the workdir (deploy.output, "
                          "model.path), or unset deploy.serve_root")

    def from_model(self, path: Path, what: str) -> str:
        """``path`` as a Python model of the repository names it: relative to its model
        folder (``<deploy>/model_repo/<model>``, all at the same depth) when both move
        together, else :meth:`absolute`."""
        path, model_dir = path.resolve(), self.deploy_dir / "model_repo" / "model"
        for root in (self.deploy_dir, self.workdir):
            if _inside(path, root) and _inside(model_dir, root):
                return Path(os.path.relpath(path, model_dir)).as_posix()
        return self.absolute(path, what)

    def repository(self) -> str:
        """The served ``<deploy>/model_repo`` (the server's ``--model-repository``)."""
        return self.absolute(self.deploy_dir / "model_repo", "deploy.output")


# Each release's own rendering, kept across deploys while pods may still serve it (the newest
# KEEP_RELEASES; a Kubernetes rollout and its rollback need the old one's repository).
RELEASES = "releases"
KEEP_RELEASES = 3


def release_dir(cfg: MoepipeConfig, version: str) -> Path:
    """``<deploy>/releases/<version>``: version ``version``'s repository, tokenizer and
    Kubernetes folder, as the pods of that release read them."""
    return cfg.deploy_dir / RELEASES / version


def release_config(cfg: MoepipeConfig, version: str) -> MoepipeConfig:
    """``cfg`` rendering into :func:`release_dir` (its relative paths are computed from there)."""
    deploy = cfg.deploy.model_copy(update={"output": release_dir(cfg, version).resolve()})
    return cfg.model_copy(update={"deploy": deploy})
