#!/usr/bin/env bash
# The test command: installs what is needed, then runs the whole suite (real model, real processes, loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the chat playground's tests drive Debian's chromium through Playwright (its own browser download cannot work);
# the team limits' tests run a real redis-server on loopback
missing=""
[ -x /usr/bin/chromium ] || missing="$missing chromium"
command -v redis-server >/dev/null || missing="$missing redis-server"
if [ -n "$missing" ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
fi
exec .venv/bin/python -m pytest "$@"
