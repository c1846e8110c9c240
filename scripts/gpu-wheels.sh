#!/usr/bin/env bash
# The py3.12 wheels the GPU machine lacks for scripts/gpu-bench.sh (the frontend's text normaliser and
# what it imports, soundfile, py-spy for the timeline's interpreter-lock samples), downloaded from
# PyPI into .gpu-wheels/ (ignored by git), which scripts/gpu-env.sh installs there.
#   scripts/gpu-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .gpu-wheels wetext kaldifst contractions textsearch anyascii pyahocorasick inflect \
    jaraco.functools more_itertools typeguard soundfile cffi pycparser py-spy
ls .gpu-wheels
