#!/usr/bin/env bash
# Layer-by-layer quantization on an NVIDIA GPU (run from anywhere in the repository, on the GPU
# machine): 1) the tiny Mixtral quantized one layer at a time on cuda and on the CPU, compared
# (tests/gpu/quantize_device_check.py: what must be equal, what within a bound); 2) the memory
# benchmark at ${LAYERS:-2,8} layers on cuda (peak host RSS and peak device memory per depth).
# Writes ${OUT:-.}/quantize_device_check.json (+ the benchmark's table); exit 0 = all agreed.
#
# Needs torch with CUDA and transformers 5; nvidia-modelopt 0.47 and blake3 are installed from
# ${WHEELS} (a folder of wheels, for the machine's Python) into a virtualenv that also sees the
# system's packages when they are missing, e.g. made on a machine with a registry:
#   pip download --no-deps -d wheels nvidia-modelopt==0.47.0 blake3 omegaconf \
#       antlr4-python3-runtime==4.9.3 pulp nvidia-ml-py ninja pydantic pydantic-core \
#       annotated-types typing-inspection
# DEVICES=cpu,cpu runs the same steps without a GPU (to check the script itself).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.}"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if ! "$PY" -c "import modelopt, blake3" 2>/dev/null; then
    if [ -z "${WHEELS:-}" ]; then
        echo "nvidia-modelopt or blake3 is missing: set WHEELS to a folder of their wheels" >&2
        exit 2
    fi
    "$PY" -m venv --system-site-packages "$OUT/venv"
    PY="$OUT/venv/bin/python"
    "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*
fi
export PYTHONPATH="$PWD/pipeline${PYTHONPATH:+:$PYTHONPATH}"
DEVICES="${DEVICES:-cuda,cpu}"
FIRST="${DEVICES%%,*}"
"$PY" -c "import torch, transformers, modelopt; print('torch', torch.__version__, 'transformers', transformers.__version__, 'modelopt', modelopt.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
if [ "$FIRST" = cuda ]; then
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'"
fi
status=0
timeout 900 "$PY" tests/gpu/quantize_device_check.py "$OUT/compare.json" --devices "$DEVICES" \
    --work "$OUT/compare" > "$OUT/compare.log" 2>&1 || status=$?
timeout 900 "$PY" benchmarks/quantize_layerwise_bench.py --layers "${LAYERS:-2,8}" \
    --device "$FIRST" --workdir "$OUT/bench" > "$OUT/quantize_bench.txt" 2>&1 || status=$?
"$PY" - "$OUT" "$status" <<'PYEOF'
import json, re, sys
from pathlib import Path
out, status = Path(sys.argv[1]), int(sys.argv[2])
compare = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
table = (out / "quantize_bench.txt").read_text()
peaks = [float(m) for m in re.findall(r"peak device ([\d.]+) GiB", table)]
result = {"ok": status == 0 and bool(compare.get("ok")), "compare": compare,
          "bench": {"table": table, "peak_device_gib": max(peaks) if peaks else None}}
(out / "quantize_device_check.json").write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({"ok": result["ok"], "peak_device_gib": result["bench"]["peak_device_gib"]}))
sys.exit(0 if result["ok"] else 1)
PYEOF
