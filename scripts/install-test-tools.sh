#!/usr/bin/env bash
# System tools the test suite drives for real, installed only where missing (reruns are
# instant). Python test tools come from the pyproject `test` extra instead.
#   chromium:   opens the validation report headless (tests/e2e)
#   prometheus: `promtool check/test rules` and a real Prometheus server for the alert test
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
{ command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; } || missing+=(prometheus)
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: ${missing[*]} missing (apt-get install ${missing[*]}); the tests that need them are skipped" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "${missing[@]}" >/dev/null
