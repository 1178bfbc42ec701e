#!/usr/bin/env bash
# The main job on the built-in tiny example, end to end:
#   init -> build (inspect, convert tp=2 / moe_ep=2) -> parity vs transformers
#   -> deploy (a real Triton server on 127.0.0.1) -> validate (smoke + accuracy) -> stop.
# Creates .venv and installs moepipe itself. Ports: MOEPIPE_HTTP_PORT (8000) and the next two.
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
WORK="${MOEPIPE_EXAMPLE_DIR:-moepipe-work/example}"
HTTP="${MOEPIPE_HTTP_PORT:-8000}"
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK"
set -x
# The tiny Mixtral trained on Pride and Prejudice: the first build on a machine trains it (about a
# minute on 2 cores) and caches it in ~/.cache/moepipe; later builds copy it.
moepipe init --example tiny-mixtral-trained --tp 2 --moe-ep 2
sed -i "s/^  http_port: 8000/  http_port: $HTTP/; s/^  grpc_port: 8001/  grpc_port: $((HTTP + 1))/; s/^  metrics_port: 8002/  metrics_port: $((HTTP + 2))/" moepipe.yaml
moepipe build
moepipe parity --hf moepipe-work/model --checkpoint moepipe-work/checkpoint
moepipe deploy
trap 'moepipe stop' EXIT
curl -s -X POST "http://127.0.0.1:$HTTP/v2/models/ensemble/generate" \
  -d '{"text_input": "It is a truth universally acknowledged", "max_tokens": 32}'
echo
moepipe validate
