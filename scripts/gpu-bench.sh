#!/usr/bin/env bash
# Benchmark the engine on a CUDA machine that has torch but no vLLM, from parts built by the
# vLLM carry build and wheels in .gpu-wheels/ (scripts/gpu-env.sh). Writes JSON to $OUT.
#   scripts/gpu-bench.sh [extra python -m cosyapp.bench arguments]
# GPU_BENCH_MPS=1 runs it under a CUDA MPS control daemon started for the run (stopped after), so the
# vLLM engine process and this one share the GPU without time slices (measured: docs/benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source scripts/gpu-env.sh
# Inductor's kernels where scripts/gpu-experiments.sh leaves them (precompile: --compile-flow's graphs),
# and vLLM's compile cache (its LM engine start took ~137 s without one on an H100): each from an
# archive a run before wrote to $OUT, carried in .gpu-carry/ (left there, or moved to /tmp/parts/ with
# the vLLM parts), and written to $OUT again at the end, new entries included (scripts/gpu-caches.sh).
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor} VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/vllm-cache}
source scripts/gpu-caches.sh
unpack_cache inductor "$TORCHINDUCTOR_CACHE_DIR"
unpack_cache vllm-cache "$VLLM_CACHE_ROOT"
keep_caches() {
    # At most 8 files come back from the GPU machine: the plots and the engine log go as one archive,
    # so bench.json, its levels, the printed log and the caches' pieces come back beside it.
    (cd "$OUT" && ls bench-*.png bench-engine.log 2> /dev/null | xargs -r tar czf bench-extras.tgz --remove-files) || true
    pack_cache inductor "$TORCHINDUCTOR_CACHE_DIR" || true
    pack_cache vllm-cache "$VLLM_CACHE_ROOT" || true
}
trap keep_caches EXIT
if [ "${GPU_BENCH_MPS:-0}" = 1 ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d
    trap 'keep_caches; echo quit | nvidia-cuda-mps-control; cp -r "$CUDA_MPS_LOG_DIRECTORY" "$OUT/mps-log" || true' EXIT
    echo "CUDA MPS control daemon started" | tee "$OUT/mps.txt"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# GPU_BENCH_LIMIT_S: stop the bench after that many seconds, still keeping the caches and the engine
# log above (a limit put around this whole script would stop it before its EXIT trap; the levels
# measured by then are in bench-levels.jsonl).
limit=()
if [ -n "${GPU_BENCH_LIMIT_S:-}" ]; then limit=(timeout -k 5 "$GPU_BENCH_LIMIT_S"); fi
"${limit[@]}" python -m cosyapp.bench --full-size --engine vllm --workdir /tmp/bench --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -vE "^(INFO|DEBUG)"
