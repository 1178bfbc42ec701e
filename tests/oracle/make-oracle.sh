#!/usr/bin/env bash
# Regenerate the quantization oracle's golden files (tests/oracle/golden) with modelopt 0.47's
# own TensorRT-LLM exporter. That exporter needs transformers 4.x, so it runs in a side
# virtualenv, created once and reused while its pins are unchanged:
#   MOEPIPE_ORACLE_VENV  where it lives (default: ~/.cache/moepipe/oracle-venv)
# Usage: tests/oracle/make-oracle.sh [--full DIR] [CASE ...]   (then: git diff tests/oracle)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${MOEPIPE_ORACLE_VENV:-${HOME}/.cache/moepipe/oracle-venv}"
python="${PYTHON:-python3}"
# torch first and pinned: pip then keeps this CPU build instead of pulling a CUDA one.
pins=(torch==2.13.0 transformers==4.57.6 nvidia-modelopt==0.47.0 "numpy<2" safetensors requests)
stamp="${venv}/.moepipe-oracle-pins"

if [[ ! -x "${venv}/bin/python" || "$(cat "${stamp}" 2>/dev/null)" != "${pins[*]}" ]]; then
    echo "make-oracle: creating ${venv} (${pins[*]})" >&2
    rm -rf "${venv}"
    "${python}" -m venv "${venv}"
    "${venv}/bin/pip" install -q --upgrade pip
    "${venv}/bin/pip" install -q "${pins[0]}"
    "${venv}/bin/pip" install -q "${pins[@]}"
    echo "${pins[*]}" > "${stamp}"
fi
exec "${venv}/bin/python" "${here}/make_oracle.py" "$@"
