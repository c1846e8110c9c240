# cosyapp with vLLM on an NVIDIA GPU (README, "Deploy"):
#   docker build -t cosyapp .
#   docker run --gpus all -p 7860:7860 -v cosyapp-cache:/cache -v cosyapp-data:/data cosyapp
# CUDA 13.0.2 is the toolkit torch 2.11.0 is built against, the torch vllm==0.26.0 pins
# (tests/test_deploy_files.py checks it against the resolved install); Ubuntu 24.04 brings Python 3.12.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Versions come from the base image's release; curl serves the health check. Triton, which runs what
# torch.compile makes (vLLM's graphs, --compile-hift, --compile-flow), builds its launcher modules with
# a C compiler and Python's headers when they are first used: the runtime image has neither.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev curl \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 app \
    && useradd --create-home --uid 10001 --gid app app \
    && mkdir -p /cache /data \
    && chown app:app /cache /data

WORKDIR /app
COPY . .
# The README's install step: .venv with cosyapp and its gpu extra (the build sees no GPU, hence --gpu).
RUN bash scripts/setup.sh --gpu

# Downloads and compile caches (the model, vLLM's compiled graphs) and the saved voices outlive the
# container on volumes; a second start skips the download and most of vLLM's compilation.
ENV HF_HOME=/cache/huggingface \
    VLLM_CACHE_ROOT=/cache/vllm \
    TRITON_CACHE_DIR=/cache/triton \
    COSYAPP_CACHE_DIR=/cache/cosyapp \
    COSYAPP_DATA_DIR=/data \
    COSYAPP_HOST=0.0.0.0
VOLUME ["/cache", "/data"]
USER 10001:10001
EXPOSE 7860

# /health answers 200 once the engines serve; the first start downloads the model and compiles vLLM.
HEALTHCHECK --interval=30s --timeout=10s --start-period=15m --retries=3 \
    CMD ["sh", "-c", "curl -fsS http://127.0.0.1:${COSYAPP_PORT:-${PORT:-7860}}/health > /dev/null"]

CMD [".venv/bin/python", "app.py"]
