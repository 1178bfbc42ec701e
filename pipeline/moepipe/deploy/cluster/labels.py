"""The labels of every Kubernetes object moepipe renders, and the selectors that find its pods.

Kubernetes' recommended labels (``app.kubernetes.io/*``): ``name`` moepipe, ``instance`` the
deployment (``deploy.k8s.name``), ``version`` moepipe's, ``component`` what the object is part
of (``server``: the pods that serve, a rank group's leader, and what fronts or budgets them;
``worker``: a group's other pods; ``dashboard``, ``monitoring``), ``managed-by`` moepipe.
Selectors use the instance and the component, never the version: a selector cannot change
after the object is created, and an upgrade changes the version.
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
SERVER, WORKER, DASHBOARD, MONITORING = "server", "worker", "dashboard", "monitoring"


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 of ``[A-Za-z0-9._-]``, alphanumeric at both
    ends): a version such as ``0.2.0+local`` becomes ``0.2.0-local``."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-_.")


def labels(app: str, component: str = SERVER) -> dict[str, str]:
    """The labels of an object or pod of deployment ``app``."""
    return {NAME_LABEL: "moepipe", INSTANCE_LABEL: app, VERSION_LABEL: label_value(__version__),
            COMPONENT_LABEL: component, MANAGED_BY_LABEL: "moepipe"}


def selector(app: str, component: str | None = None) -> dict[str, str]:
    """The labels that select ``app``'s pods: of one ``component``, or all of them."""
    return {INSTANCE_LABEL: app, **({COMPONENT_LABEL: component} if component else {})}


def meta(name: str, app: str, component: str = SERVER) -> dict[str, Any]:
    """An object's ``metadata``: its name and labels."""
    return {"name": name, "labels": labels(app, component)}
