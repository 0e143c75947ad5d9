#!/usr/bin/env bash
# The test command: installs what is needed, then runs the whole suite (real model, real processes, loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
