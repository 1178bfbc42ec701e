#!/usr/bin/env bash
# GPU check of the routing kernel (run from the repository root on a machine with an NVIDIA
# GPU, torch with CUDA and triton==3.7.1): every mode vs the reference, then kernel vs torch
# at T=8192, E=256, k=8, n_group=8. Writes ${OUT:-.}/device_check.json; exit 0 = all equal.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA GPU'; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 900 "$PY" plugins/device_check.py "${OUT:-.}/device_check.json"
