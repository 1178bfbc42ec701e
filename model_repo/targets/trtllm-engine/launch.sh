#!/usr/bin/env bash
# moepipe `trtllm-engine` launcher: one tritonserver MPI rank per GPU (TensorRT-LLM's leader
# mode). Rank 0 serves HTTP, gRPC and metrics; the other ranks only load tensorrt_llm and run
# their share of the engine. Rendered by moepipe; run it inside ${trtllm_container}.
#
# It refuses to start (one line on stderr, exit status 1) unless the engine's own config.json
# agrees with what moepipe rendered: its world size (tp x pp) equals the rendered one and the
# number of visible GPUs, and its TensorRT-LLM version is the one installed here.
set -u

DEPLOY_DIR="${deploy_dir}"
MODEL_REPO="$DEPLOY_DIR/model_repo"
ENGINE_DIR="${engine_dir}"
WORLD_SIZE=${world_size}  # tp=${tp_size} x pp=${pp_size}, from moepipe.yaml
MAX_BEAM_WIDTH=${max_beam_width}
HOST="${host}"
HTTP_PORT=${http_port}
GRPC_PORT=${grpc_port}
METRICS_PORT=${metrics_port}
TRITONSERVER="${tritonserver}"
CONTAINER="${trtllm_container}"

die() {
    echo "error: $*" >&2
    exit 1
}

[ "$#" -eq 0 ] || die "launch.sh takes no arguments (hint: change moepipe.yaml and run \`moepipe deploy\` again)"

# --- the engine: what it was built for -----------------------------------------------------
[ -f "$ENGINE_DIR/config.json" ] || die "no TensorRT-LLM engine at $ENGINE_DIR (no config.json) (hint: run \`moepipe build\` on the GPU machine first)"
command -v python3 >/dev/null 2>&1 || die "python3 not found, needed to read $ENGINE_DIR/config.json (hint: run inside $CONTAINER)"

# Prints "world_size tp pp max_beam_width version" of an engine config.json (trtllm-build:
# {version, pretrained_config: {mapping: {...}}, build_config: {...}}), or exits 1 with a reason.
facts=$(python3 - "$ENGINE_DIR/config.json" 2>&1 <<'PYTHON'
import json
import sys

path = sys.argv[1]
try:
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("pretrained_config"), dict) \
            or not isinstance(cfg.get("build_config"), dict):
        sys.exit(f"{path} is not a TensorRT-LLM engine config (no pretrained_config and "
                 "build_config; is it a checkpoint?)")
    mapping = cfg["pretrained_config"].get("mapping") or {}
    tp, pp, cp = (int(mapping.get(k) or 1) for k in ("tp_size", "pp_size", "cp_size"))
    world = int(mapping.get("world_size") or tp * pp * cp)
    if world != tp * pp * cp:
        sys.exit(f"{path}: mapping.world_size {world} != tp_size {tp} x pp_size {pp} x "
                 f"cp_size {cp}")
    beam = int(cfg["build_config"].get("max_beam_width") or 1)
    version = str(cfg.get("version") or "").strip()
    if not version or " " in version:
        sys.exit(f"{path} records no TensorRT-LLM version")
    print(world, tp, pp, beam, version)
except (OSError, ValueError, TypeError, AttributeError) as e:
    sys.exit(f"cannot read {path}: {e}")
PYTHON
) || die "$(echo "$facts" | tail -n 1)"
read -r ENGINE_WORLD ENGINE_TP ENGINE_PP ENGINE_BEAM ENGINE_VERSION <<< "$facts"

[ "$ENGINE_WORLD" -eq "$WORLD_SIZE" ] || die "the engine at $ENGINE_DIR was built for world size $ENGINE_WORLD (tp=$ENGINE_TP x pp=$ENGINE_PP), but this deployment was rendered for world size $WORLD_SIZE (hint: rebuild the engine with \`moepipe build\`, or fix parallel.tp / parallel.pp and run \`moepipe deploy\` again)"
[ "$ENGINE_BEAM" -ge "$MAX_BEAM_WIDTH" ] || die "deploy.trtllm.max_beam_width is $MAX_BEAM_WIDTH but the engine was built for at most $ENGINE_BEAM (hint: lower max_beam_width or rebuild the engine)"
rank=0
while [ "$rank" -lt "$WORLD_SIZE" ]; do
    [ -f "$ENGINE_DIR/rank$rank.engine" ] || die "$ENGINE_DIR/rank$rank.engine is missing (hint: the engine build did not finish; run \`moepipe build\` again)"
    rank=$((rank + 1))
done

# --- this machine: GPUs and TensorRT-LLM ----------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 || die "no NVIDIA GPU visible: nvidia-smi not found (hint: run inside $CONTAINER with --gpus all on a machine with $WORLD_SIZE GPUs)"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
visible=$gpus
if cuda_devices=$(printenv CUDA_VISIBLE_DEVICES); then
    visible=$(printf '%s\n' "$cuda_devices" | tr ',' '\n' | grep -c '[^[:space:]]')
    [ "$visible" -le "$gpus" ] || visible=$gpus
fi
[ "$visible" -eq "$WORLD_SIZE" ] || die "$visible GPU(s) visible here but the engine needs exactly $WORLD_SIZE, one per rank (hint: set CUDA_VISIBLE_DEVICES to $WORLD_SIZE GPUs)"

installed=$(python3 -c 'import tensorrt_llm; print(tensorrt_llm.__version__)' 2>/dev/null) \
    || die "TensorRT-LLM is not importable by python3 here (hint: run inside $CONTAINER)"
installed=$(printf '%s\n' "$installed" | tail -n 1)  # importing it may print a banner first
[ "$installed" = "$ENGINE_VERSION" ] || die "TensorRT-LLM $installed is installed here but the engine was built with $ENGINE_VERSION (hint: run inside the container of $ENGINE_VERSION, or rebuild the engine here)"

command -v mpirun >/dev/null 2>&1 || die "mpirun not found (hint: run inside $CONTAINER)"
command -v "$TRITONSERVER" >/dev/null 2>&1 || die "tritonserver not found: $TRITONSERVER (hint: run inside $CONTAINER, or set deploy.tritonserver)"
[ -d "$MODEL_REPO" ] || die "no model repository at $MODEL_REPO (hint: run \`moepipe deploy\` again)"

# --- one rank per GPU, ranks joined by ':' ------------------------------------------------
# Every rank gets the deployment's flags (moepipe.deploy.tritonserver.ServerCommand), as
# TensorRT-LLM's launch_triton_server.py does: worker ranks never open their endpoints (they
# stay inside the tensorrt_llm model's initialisation until rank 0 shuts down). Each rank needs
# its own Python-backend shared-memory prefix.
${mpi_ranks}

# Triton's HTTP frontend (libevhtp, 2.51 measured) parses a form-encoded body into stack arrays
# of its size: 1 GiB thread stacks (address space, not memory) take bodies to ~400 MB instead of
# dying at ~4 MB with the usual 8 MiB. Best effort: a lower hard limit is kept.
${raise_stack}

echo "launch: $WORLD_SIZE rank(s) of $TRITONSERVER, serving http://$HOST:$HTTP_PORT, grpc $HOST:$GRPC_PORT, metrics http://$HOST:$METRICS_PORT/metrics" >&2
exec mpirun --allow-run-as-root "$@"
