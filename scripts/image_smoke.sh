#!/usr/bin/env bash
# The images as users run them (too slow for the test command; run it before resolving any change to the images,
# compose or the manifests, and put its result with the date in docs/deploy.md):
#
#   bash scripts/image_smoke.sh --base python:3.11-slim --torch-index <PyTorch's CPU wheel index>   [--no-build: reuse]
#   bash scripts/image_smoke.sh --base localhost/pybase:3.11 --torch-index http://127.0.0.1:8765/simple \
#     --build-flags "--format docker --isolation chroot --network host" --run-flags "--runtime runc --ulimit nofile=20000:20000 --ulimit nproc=4096:4096"
#
# (the second: podman on these machines, after `bash ../shared/images/podman-setup.sh`, which prints those flags).
# Builds the server and proxy images with podman (or docker: --engine docker), then checks
#   1. the one-container stack (`docker run` of the server image): health, 401 without a token, a streamed answer
#      with one, the non-root user, the kernels loaded (no "unavailable" line), and a stream that outlives `stop`
#      (the stop timeout above the stack's drain): it ends with [DONE] and the container exits 0;
#   2. the proxy image in front of the server image, as compose runs them (the server alone on 8000 with
#      INTERNAL_SECRET, the proxy forwarding to it; here on the host's network, loopback only): the same checks,
#      and a stream through the proxy that outlives `stop` of both containers with compose's grace periods (the
#      proxy first, then the server, as compose stops a service before the one it depends on): it ends with [DONE]
#      and both exit 0.
# Every container listens on 127.0.0.1 only and is removed at the end. Exit status 0 when every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=$(command -v podman || command -v docker || true)
BASE=python:3.11-slim
TORCH_INDEX=""
BUILD_FLAGS=""
RUN_FLAGS=""
PORT=${SMOKE_PORT:-18223}
BUILD=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) BUILD=0; shift ;;
    --engine) ENGINE=$2; shift 2 ;;
    --base) BASE=$2; shift 2 ;;
    --torch-index) TORCH_INDEX=$2; shift 2 ;;
    --build-flags) BUILD_FLAGS=$2; shift 2 ;;
    --run-flags) RUN_FLAGS=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$ENGINE" ] || { echo "no podman or docker" >&2; exit 2; }
[ -n "$TORCH_INDEX" ] || { echo "pass --torch-index <PyTorch's CPU wheel index>" >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
SECRET=$("$PY" -c "import secrets; print(secrets.token_urlsafe(48))")
INTERNAL=$("$PY" -c "import secrets; print(secrets.token_urlsafe(48))")
TOKEN=$(JWT_SECRET="$SECRET" "$PY" scripts/jwt_util.py encode '{"team_id": "smoke", "token_id": "smoke"}')
SERVER=llm-smoke-server PROXY=llm-smoke-proxy
failed=0
ok() { echo "ok    $*"; }
bad() { echo "FAIL  $*"; failed=1; }
cleanup() { $ENGINE rm -f smoke-stack smoke-server smoke-proxy >/dev/null 2>&1 || true; }
trap cleanup EXIT

if [ $BUILD = 1 ]; then
echo "== build ($ENGINE, base $BASE)"
start=$(date +%s)
# shellcheck disable=SC2086
$ENGINE build $BUILD_FLAGS --build-arg PYTHON_IMAGE="$BASE" --build-arg TORCH_INDEX_URL="$TORCH_INDEX" -t $SERVER . >/tmp/smoke-build-server.log 2>&1 \
  || { tail -30 /tmp/smoke-build-server.log; exit 1; }
# shellcheck disable=SC2086
$ENGINE build $BUILD_FLAGS --build-arg PYTHON_IMAGE="$BASE" --target proxy -t $PROXY . >/tmp/smoke-build-proxy.log 2>&1 \
  || { tail -30 /tmp/smoke-build-proxy.log; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
fi
echo "sizes: $($ENGINE image ls --format '{{.Repository}} {{.Size}}' | grep llm-smoke | tr '\n' ' ')"

wait_health() {  # url, seconds
  for _ in $(seq "$2"); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1/health")" = 200 ] && return 0
    sleep 1
  done
  return 1
}

check_front() {  # name, base url, container holding the server
  local url=$2
  [ "$(curl -s -o /dev/null -w '%{http_code}' -X POST "$url/v1/completions" -H 'Content-Type: application/json' -d '{}')" = 401 ] \
    && ok "$1: 401 without a token" || bad "$1: no 401 without a token"
  local out
  out=$(curl -sN "$url/v1/completions" -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8, "stream": true}')
  echo "$out" | grep -q '^data: \[DONE\]' && [ "$(echo "$out" | grep -c '^data: {')" -ge 2 ] \
    && ok "$1: a streamed answer with a token" || bad "$1: no streamed answer: ${out:0:300}"
  [ "$($ENGINE exec "$3" id -u)" = 10001 ] && ok "$1: runs as user 10001" || bad "$1: not user 10001"
  if $ENGINE logs "$3" 2>&1 | grep -q "kernels unavailable"; then bad "$1: kernels unavailable"; else ok "$1: kernels loaded"; fi
}

echo "== one container: server + proxy (docker run)"
start=$(date +%s)
# shellcheck disable=SC2086
$ENGINE run -d $RUN_FLAGS --name smoke-stack --stop-timeout 120 -e JWT_SECRET="$SECRET" -p 127.0.0.1:$PORT:1223 $SERVER >/dev/null
if wait_health "http://127.0.0.1:$PORT" 300; then
  ok "stack: healthy after $(( $(date +%s) - start )) s"
  check_front stack "http://127.0.0.1:$PORT" smoke-stack
  # a stream that outlives stop: 64 tokens (well within the server's 60 s drain), stopped while it runs
  curl -sN "http://127.0.0.1:$PORT/v1/completions" -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": true, "stream": true}' \
    >/tmp/smoke-stream.txt &
  streamer=$!
  sleep 1
  stop_start=$(date +%s)
  $ENGINE stop -t 120 smoke-stack >/dev/null
  wait $streamer && grep -q '^data: \[DONE\]' /tmp/smoke-stream.txt \
    && ok "stack: a running stream finished across stop ($(( $(date +%s) - stop_start )) s to stop)" \
    || bad "stack: the stream was cut by stop"
  code=$($ENGINE inspect -f '{{.State.ExitCode}}' smoke-stack)
  [ "$code" = 0 ] && ok "stack: exit status 0 after the drain" || bad "stack: exit status $code"
else
  bad "stack: not healthy in 300 s"; $ENGINE logs smoke-stack 2>&1 | tail -20
fi

echo "== two containers: the proxy image in front of the server image (as compose)"
# shellcheck disable=SC2086
$ENGINE run -d $RUN_FLAGS --name smoke-server --network host -e INTERNAL_SECRET="$INTERNAL" -e PORT=$((PORT + 1)) \
  $SERVER python -m inference_api --host 127.0.0.1 --port $((PORT + 1)) >/dev/null
# shellcheck disable=SC2086
$ENGINE run -d $RUN_FLAGS --name smoke-proxy --network host -e JWT_SECRET="$SECRET" -e INTERNAL_SECRET="$INTERNAL" \
  -e PROXY_HOST=127.0.0.1 -e PROXY_PORT=$((PORT + 2)) -e UPSTREAM_URL=http://127.0.0.1:$((PORT + 1)) $PROXY >/dev/null
if wait_health "http://127.0.0.1:$((PORT + 2))" 300; then
  ok "pair: the proxy is healthy with the server behind it"
  check_front pair "http://127.0.0.1:$((PORT + 2))" smoke-server
  [ "$($ENGINE exec smoke-proxy id -u)" = 10001 ] && ok "pair: the proxy runs as user 10001" || bad "pair: proxy not user 10001"
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$((PORT + 1))/v1/models")" = 403 ] \
    && ok "pair: the server refuses requests without the internal secret" || bad "pair: the server answers without the internal secret"
  # compose's stop: the proxy (105 s grace, 90 s drain) and then the server (75 s grace, 60 s drain)
  curl -sN "http://127.0.0.1:$((PORT + 2))/v1/completions" -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": true, "stream": true}' \
    >/tmp/smoke-pair-stream.txt &
  streamer=$!
  sleep 1
  stop_start=$(date +%s)
  $ENGINE stop -t 105 smoke-proxy >/dev/null
  $ENGINE stop -t 75 smoke-server >/dev/null
  wait $streamer && grep -q '^data: \[DONE\]' /tmp/smoke-pair-stream.txt \
    && ok "pair: a running stream finished across both stops ($(( $(date +%s) - stop_start )) s to stop)" \
    || bad "pair: the stream was cut by stop"
  for c in smoke-proxy smoke-server; do
    code=$($ENGINE inspect -f '{{.State.ExitCode}}' $c)
    [ "$code" = 0 ] && ok "pair: $c exit status 0 after its drain" || bad "pair: $c exit status $code"
  done
else
  bad "pair: not healthy in 300 s"; $ENGINE logs smoke-proxy 2>&1 | tail -20; $ENGINE logs smoke-server 2>&1 | tail -20
fi
[ $failed = 0 ] && echo "== every check passed" || echo "== some checks FAILED"
exit $failed
