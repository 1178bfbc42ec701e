#!/usr/bin/env bash
# The main job on the built-in tiny example: example -> convert (tp=2, moe_ep=2) -> parity
# against Hugging Face transformers. Creates .venv and installs moepipe itself.
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
WORK="${MOEPIPE_EXAMPLE_DIR:-moepipe-work/example}"
rm -rf "$WORK" && mkdir -p "$WORK"
set -x
moepipe example tiny-mixtral --out "$WORK/tiny-mixtral"
moepipe inspect "$WORK/tiny-mixtral"
moepipe convert --model "$WORK/tiny-mixtral" --output "$WORK/tiny-mixtral-trtllm" --tp 2 --moe-ep 2
moepipe parity --hf "$WORK/tiny-mixtral" --checkpoint "$WORK/tiny-mixtral-trtllm"
