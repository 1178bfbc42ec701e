#!/usr/bin/env bash
# What the test suite needs besides moepipe itself, installed only where missing (reruns are
# quick):
#   Python test tools: the `test` dependency group of pyproject.toml (PEP 735), into the
#       venv scripts/bootstrap.sh made ($MOEPIPE_VENV, default .venv); pip reads groups
#       from 25.1 on, so an older pip is upgraded first
#   chromium:   opens the validation report headless (tests/e2e)
#   prometheus: `promtool check/test rules` and a real Prometheus server for the alert test
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MOEPIPE_VENV:-.venv}"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "${PIP[@]}" install --help | grep -q -- "--group"; then
    "${PIP[@]}" install "pip>=25.1"
fi
"${PIP[@]}" install --group test 2>&1 | grep -v "^WARNING: Location" || true
# the group is there, or this fails
"$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('pytest', 'locust', 'deptry')))"

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
