#!/usr/bin/env bash
# The checks and figures that need an NVIDIA GPU, in one run: where a decode step's time goes
# (scripts/profile_decode.py), the benchmark of the default model on CUDA with the decode step in CUDA graphs and
# without (scripts/bench.py, 1, 8 and 32 streams), then the CUDA tests. Every stage is
# bounded in time; logs go to $OUT (default test-artifacts/cuda). Run on a machine with the server's dependencies:
#
#     bash scripts/cuda_check.sh                 # PYTHON=... to pick the interpreter, REPEAT=3 runs per load
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-test-artifacts/cuda}
py=${PYTHON:-python3}
repeat=${REPEAT:-3}
port=18090
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

# the decode step's GPU time (graph replay, eager) and kernels, without a server
timeout 180 "$py" scripts/profile_decode.py 2>&1 | tee "$out/profile.log" | tail -8

serve() {  # serve the default model on CUDA with these flags, wait until it is healthy (or give up after 240 s)
  "$py" -m inference_api --host 127.0.0.1 --port $port --device cuda --tokens-per-minute-per-team 0 "$@" \
    >"$out/server$1.log" 2>&1 &
  server=$!
  for _ in $(seq 480); do
    "$py" -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen('http://127.0.0.1:$port/health').read().decode())" \
      >"$out/health$1.json" 2>/dev/null && return 0
    kill -0 $server 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

for graphs in --cuda-graphs --no-cuda-graphs; do
  if serve $graphs; then
    cat "$out/health$graphs.json"; echo
    timeout 240 "$py" scripts/bench.py --url "http://127.0.0.1:$port" --api openai --ignore-eos --max-tokens 96 \
      --concurrency 1 8 32 --repeat "$repeat" 2>&1 | tee "$out/bench$graphs.log" | tail -30
  else
    echo "server $graphs did not start"; tail -30 "$out/server$graphs.log"
  fi
  kill -TERM $server 2>/dev/null; wait $server 2>/dev/null
done

timeout ${TEST_TIMEOUT:-420} "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_graphs.py -s \
  2>&1 | tee "$out/tests.log" | grep -E "passed|failed|error|part|perplexity|PASS|FAIL|Error|assert" | tail -40
