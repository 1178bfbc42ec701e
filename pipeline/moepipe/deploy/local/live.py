"""The running cpu deployment's live-update channel, from outside: one command per connection
to the ``tensorrt_llm`` model's control socket (:mod:`moepipe.serving.live` is the other end),
and the record of the versions served (``versions.json`` in the state folder: the serving one
and the one before, which ``moepipe deploy --rollback`` returns to)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from moepipe.deploy.local.state import CONTROL_SOCKET, ServerError
from moepipe.utils import unixsock
from moepipe.utils.fs import write_text_atomic

VERSIONS_FILE = "versions.json"


class Unreachable(ServerError):
    """The running server has no live-update channel (or it does not answer)."""


def ask(state_dir: Path, cmd: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """Send ``cmd`` to the model; its answer. A refusal is a ServerError with the model's
    reason; no channel is :class:`Unreachable`."""
    path = state_dir / CONTROL_SOCKET
    try:
        with unixsock.connect(path, timeout) as sock:
            unixsock.send(sock, cmd)
            answer = unixsock.receive(sock)
    except (OSError, ConnectionError, ValueError) as e:
        raise Unreachable(f"the server's live-update channel {path} does not answer ({e})",
                          "a server deployed by an older moepipe has none: it restarts") \
            from None
    if not isinstance(answer, dict) or not answer.get("ok"):
        why = answer.get("error") if isinstance(answer, dict) else repr(answer)
        raise ServerError(f"the server refused '{cmd.get('op')}': {why}",
                          (answer.get("hint") if isinstance(answer, dict) else None)
                          or "see the server log")
    return answer


def serving_version(state_dir: Path) -> str | None:
    """The weights version the running model serves (None: it does not say)."""
    try:
        return ask(state_dir, {"op": "status"}, timeout=2.0).get("version") or None
    except ServerError:
        return None


def read_versions(state_dir: Path) -> dict[str, Any]:
    """``{"serving": {...}, "previous": {...}}`` as the last deploy recorded them."""
    try:
        data = json.loads((state_dir / VERSIONS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_versions(state_dir: Path, serving: dict[str, Any],
                    previous: dict[str, Any] | None) -> None:
    """Remember what serves now and what served before (for ``--rollback``)."""
    data = {"serving": {**serving, "since": time.time()}, "previous": previous}
    write_text_atomic(state_dir / VERSIONS_FILE, json.dumps(data, indent=2) + "\n")
