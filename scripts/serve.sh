#!/usr/bin/env bash
# The run command: installs what is needed, then serves the default model behind the JWT proxy.
# Extra flags go to the inference server, e.g. `bash scripts/serve.sh --mock`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/run_stack.py "$@"
