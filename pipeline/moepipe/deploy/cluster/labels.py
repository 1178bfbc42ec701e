"""The labels of every Kubernetes object moepipe renders, and the selectors that find its pods.

Kubernetes' recommended labels (``app.kubernetes.io/*``): ``name`` moepipe, ``instance`` the
deployment (``deploy.k8s.name``), ``version`` moepipe's, ``component`` what the object is part
of (``server``: the pods that serve, a rank group's leader, and what fronts or budgets them;
``worker``: a group's other pods; ``dashboard``, ``monitoring``), ``managed-by`` moepipe.
Selectors use the instance and the component, never the version: a selector cannot change
after the object is created, and an upgrade changes the version.

A *release* (the build a workload serves, ``moepipe status``'s version) is the label
``moepipe.dev/release``: each release is its own workload (``<app>-<release[:8]>``) whose
selector holds it, so a new release is a new object beside the old one (blue/green,
:mod:`moepipe.deploy.cluster.rollout`), never a changed selector. The stable Service selects
the serving release; Services' selectors may change (the switch).
"""

from __future__ import annotations

import re
from typing import Any

from moepipe import __version__

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
VERSION_LABEL = "app.kubernetes.io/version"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
RELEASE_LABEL = "moepipe.dev/release"
SERVER, WORKER, DASHBOARD, MONITORING = "server", "worker", "dashboard", "monitoring"


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 of ``[A-Za-z0-9._-]``, alphanumeric at both
    ends): a version such as ``0.2.0+local`` becomes ``0.2.0-local``."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-_.")


def labels(app: str, component: str = SERVER, release: str | None = None) -> dict[str, str]:
    """The labels of an object or pod of deployment ``app`` (of one ``release``)."""
    return {NAME_LABEL: "moepipe", INSTANCE_LABEL: app, VERSION_LABEL: label_value(__version__),
            COMPONENT_LABEL: component, MANAGED_BY_LABEL: "moepipe",
            **({RELEASE_LABEL: release} if release else {})}


def selector(app: str, component: str | None = None,
             release: str | None = None) -> dict[str, str]:
    """The labels that select ``app``'s pods: of one ``component`` and ``release``, or all."""
    return {INSTANCE_LABEL: app, **({COMPONENT_LABEL: component} if component else {}),
            **({RELEASE_LABEL: release} if release else {})}


def meta(name: str, app: str, component: str = SERVER,
         release: str | None = None) -> dict[str, Any]:
    """An object's ``metadata``: its name and labels."""
    return {"name": name, "labels": labels(app, component, release)}
