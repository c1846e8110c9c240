#!/usr/bin/env bash
# One flow or HiFT experiment of docs/benchmarks/README.md ("Compile experiments for the next GPU
# run") on a CUDA machine; none needs vLLM, so each can run before vLLM is unpacked there.
#   scripts/gpu-experiments.sh NAME [SECONDS]
# NAME: precompile (--compile-flow's forward graphs compiled and captured as an engine's start does,
# timed; the kernels stay in /tmp/inductor, where scripts/gpu-bench.sh's engine then finds them),
# serve (--compile-flow against eager, both flow paths, the attention-inputs pool as served),
# blocks (the same with the incremental step's transformer blocks compiled whole, not served),
# step (the incremental step and the whole-clip forward compiled whole, against eager),
# step-autotune (the same in max-autotune mode), whole (whole-clip variants), hift (--compile-hift),
# hift-cold (eager HiFT's first call at batch sizes not run before, against its second), hift-beside
# (HiFT's first-chunk call beside a flow call and other neighbours, its launches traced), start (the
# engine's start as served, --compile-flow included, with the PyTorch LM instead of vLLM, then one
# 1-stream level: every thread's stack dumped each minute without progress; an H200's start with
# vLLM logged nothing after its 48-row warm-up buckets for 3.7 min, docs/benchmarks/README.md,
# twelfth round; needs .gpu-wheels/).
# SECONDS: the experiment's time limit (default 480), so the call returns what it measured: the
# scripts rewrite their JSON after every row. Writes NAME.json, NAME.log and inductor.tgz.NN (the
# compiled kernels; put back in .gpu-carry/, a later run starts from them) to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
source scripts/gpu-caches.sh
unpack_cache inductor "$TORCHINDUCTOR_CACHE_DIR"
name=${1:?an experiment: precompile, serve, blocks, step, step-autotune, whole, hift, hift-cold, hift-beside or start}
limit=${2:-480}
whole_variants=no_mask,no_mask_half_layer_norms,no_mask_compiled_forward
case "$name" in
precompile) run=(python scripts/flow_precompile.py "$OUT/$name.json") ;;
serve) run=(env FLOW_CACHE_INPUTS=1 FLOW_CACHE_BATCHES=16,64
    python scripts/flow_compile_speed.py "$OUT/$name.json") ;;
blocks) run=(env FLOW_CACHE_INPUTS=1 FLOW_CACHE_BATCHES=16,64 FLOW_CACHE_COMPILE_SCOPE=blocks
    python scripts/flow_compile_speed.py "$OUT/$name.json") ;;
step) run=(env FLOW_CACHE_COMPILE_SCOPE=step FLOW_CACHE_BATCHES=1,16,64
    python scripts/flow_compile_speed.py "$OUT/$name.json") ;;
step-autotune) run=(env FLOW_CACHE_COMPILE_SCOPE=step FLOW_CACHE_BATCHES=16,64
    FLOW_CACHE_COMPILE_MODE=max-autotune-no-cudagraphs python scripts/flow_compile_speed.py "$OUT/$name.json") ;;
whole) run=(env FLOW_PROFILE_BATCHES= FLOW_PROFILE_WHOLE=23,64 FLOW_PROFILE_WHOLE_VARIANTS=$whole_variants
    python scripts/flow_profile.py "$OUT/$name.json") ;;
hift) run=(python scripts/hift_speed.py "$OUT/$name.json") ;;
hift-cold) run=(env HIFT_SPEED_COLD=1 python scripts/hift_speed.py "$OUT/$name.json") ;;
hift-beside) run=(python scripts/hift_beside.py "$OUT/$name.json") ;;
start)
    # the frontend's wheels only (scripts/gpu-env.sh would unpack vLLM too)
    mkdir -p /tmp/site && python -m pip install -q --no-deps --target /tmp/site .gpu-wheels/*.whl
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    run=(python -m cosyapp.bench --full-size --engine torch --drivers pipeline --texts tokens --tokens 260
        --modes stream --clients 1 --stall-dump-s 60 --workdir /tmp/bench --out "$OUT/$name.json") ;;
*) echo "unknown experiment: $name" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "$limit" "${run[@]}" 2>&1 | tee "$OUT/$name.log" | grep -v Warning
status=${PIPESTATUS[0]}
pack_cache inductor "$TORCHINDUCTOR_CACHE_DIR"
exit "$status"
