#!/usr/bin/env bash
# Create (or reuse) the project virtualenv at $MOEPIPE_VENV (default .venv) and install
# moepipe into it - non-editable, exactly as a user would get it - with the extras in
# $MOEPIPE_EXTRAS (default all: the cpu target's Triton server, quantize, plugins). The test
# tools are the `test` dependency group: scripts/install-test-tools.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MOEPIPE_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -U pip >/dev/null 2>&1 || true
# torch first, pinned: the package asks for a range, and an unpinned torch would pull a
# multi-GB CUDA build. 2.13.0 is the CPU build these machines carry.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" install "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
# setuptools reuses ./build/lib: a module deleted from the tree would otherwise still ship
rm -rf build
"${PIP[@]}" install ".[${MOEPIPE_EXTRAS:-all}]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import moepipe, torch; print(f'moepipe {moepipe.__version__} (torch {torch.__version__}) in $VENV')"
