#!/usr/bin/env bash
# System tools the test suite drives for real, installed only where missing (reruns are
# instant): Debian's chromium opens the validation report headless (tests/e2e).
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "note: chromium is missing (apt-get install chromium); the report's browser test is skipped" >&2
  fi
fi
