#!/usr/bin/env bash
# The one script moepipe's CI pipelines run (ci/github-actions.yml, ci/gitlab-ci.yml); the
# test suite runs it too, so what CI does is tested. Each step is one moepipe command line:
#
#   ci/moepipe-ci.sh build            moepipe build (stages reused by their fingerprints when
#                                     the workdir was restored from the CI cache)
#   ci/moepipe-ci.sh deploy-validate  cpu target: moepipe deploy, validate, stop; the JSON +
#                                     JUnit reports are copied to $MOEPIPE_REPORTS
#   ci/moepipe-ci.sh gpu-validate     trtllm-engine on a GPU runner: deploy, launch.sh in the
#                                     background, wait for ready, validate, stop
#
# Environment: MOEPIPE_CONFIG (default moepipe.yaml), MOEPIPE_REPORTS (default ci-reports),
# MOEPIPE (the moepipe command, default moepipe), PYTHON (the Python that has moepipe, default
# python3), MOEPIPE_READY_TIMEOUT_S (gpu-validate, default 1800).
set -euo pipefail

CONFIG="${MOEPIPE_CONFIG:-moepipe.yaml}"
REPORTS="${MOEPIPE_REPORTS:-ci-reports}"
MOEPIPE="${MOEPIPE:-moepipe}"
PY="${PYTHON:-python3}"

die() {
    echo "error: $*" >&2
    exit 2
}

[ "$#" -eq 1 ] || die "usage: $0 build|deploy-validate|gpu-validate (hint: see the header of $0)"
[ -f "$CONFIG" ] || die "no pipeline config at $CONFIG (hint: run \`moepipe init\`, or set MOEPIPE_CONFIG)"

# A path or address as the config resolves it: reports | deploy_dir | http.
config_value() {
    "$PY" - "$CONFIG" "$1" <<'PYTHON'
import sys

from moepipe.config import load_config

cfg = load_config(sys.argv[1])
print({"reports": cfg.workdir / "reports", "deploy_dir": cfg.deploy_dir,
       "http": f"{cfg.deploy.host}:{cfg.deploy.http_port}"}[sys.argv[2]])
PYTHON
}

copy_reports() {
    mkdir -p "$REPORTS"
    src="$(config_value reports)" || return 0
    if [ -d "$src" ]; then
        cp -R "$src"/. "$REPORTS"/
    fi
}

case "$1" in
build)
    "$MOEPIPE" build -c "$CONFIG"
    ;;
deploy-validate)
    "$MOEPIPE" deploy -c "$CONFIG"
    trap '"$MOEPIPE" stop -c "$CONFIG" >/dev/null || true; copy_reports' EXIT
    "$MOEPIPE" validate -c "$CONFIG"
    ;;
gpu-validate)
    "$MOEPIPE" deploy -c "$CONFIG"
    launch="$(config_value deploy_dir)/launch.sh"
    [ -f "$launch" ] || die "no $launch: gpu-validate is for the trtllm-engine target"
    bash "$launch" &
    server=$!
    trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; copy_reports' EXIT
    url="$(config_value http)"
    waited=0
    until curl -fsS "http://$url/v2/health/ready" >/dev/null 2>&1; do
        kill -0 "$server" 2>/dev/null || die "launch.sh exited before the server was ready"
        waited=$((waited + 5))
        [ "$waited" -le "${MOEPIPE_READY_TIMEOUT_S:-1800}" ] || die "not ready after $waited s"
        sleep 5
    done
    "$MOEPIPE" validate -c "$CONFIG" --url "$url"
    ;;
*)
    die "unknown step '$1' (hint: build, deploy-validate or gpu-validate)"
    ;;
esac
