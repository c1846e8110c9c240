"""--compile-flow's graphs compiled ahead of an engine's start, and timed, on a CUDA machine:
CosyVoice2-0.5B flow sizes with random weights, prepared as the engine prepares its flow
(engine/build.py prepare_flow), then every CUDA-graph bucket of the estimator captured as the
token2wav worker's start does (eagerly, while the compile thread compiles the two graphed attention
modes and the third, full attention without a mask; then it captures the buckets again), timing
both, then whole clips past the buckets, which run that third mode and should compile nothing more
(their first call's time says so). Prints JSON lines and writes them to the file given.

    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH=$PWD python scripts/flow_precompile.py [out.json]

Inductor keeps the kernels in TORCHINDUCTOR_CACHE_DIR, so a later process with the same setting
(an engine started by scripts/gpu-bench.sh, say) reads them there instead of compiling them again.
FLOW_CACHE_SMOKE=1 runs it on the CPU (no graphs to capture there), to check the script.
"""

import os
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from flow_cache_speed import DEVICE, SMOKE, TOKENS, recorder, timed, voice, whole_clip  # noqa: E402

from cosyapp.engine.build import flow_autocast_dtype, prepare_flow  # noqa: E402
from cosyapp.engine.token2wav.compiling import COMPILER  # noqa: E402
from cosyapp.engine.token2wav.graphs import capture_estimator_graphs  # noqa: E402
from cosyapp.options import ServeOptions  # noqa: E402

# past the graphs' largest bucket: eager, every clip the same length
WHOLE_BATCHES = (1,) if SMOKE else (16, 32)


def main() -> None:
    emit = recorder(sys.argv[1] if len(sys.argv) > 1 else "flow-precompile.json")
    torch.manual_seed(0)
    from cosyapp.models.flow import CausalMaskedDiffWithXvec

    flow = CausalMaskedDiffWithXvec().to(DEVICE).eval()
    options = ServeOptions(compile_flow=True, cache_dir=Path(tempfile.mkdtemp(prefix="serving-cache-")))
    prepare_flow(flow, DEVICE, options)
    emit({"check": "precompile_setup", "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"]})
    started = time.perf_counter()
    served = types.SimpleNamespace(flow=flow, device=DEVICE)  # what capture_estimator_graphs reads
    buckets = capture_estimator_graphs(served, flow_autocast_dtype(DEVICE, options))
    emit({"check": "graphed_modes", "buckets": buckets, "seconds": round(time.perf_counter() - started, 1)})
    # The engine compiles on a thread of its own meanwhile (compiling.py); here, wait for it.
    COMPILER.wait()
    seconds = round(time.perf_counter() - started, 1)
    # Buckets captured again after compiles (None on a CPU: no graphs); a compile recaptures only the
    # graphs that ran its kind.
    graphed = flow.decoder.estimator
    recaptured = getattr(graphed, "recaptured", None)
    emit({"check": "compiled", "kinds": COMPILER.compiled, "seconds": seconds, "recaptured": recaptured})
    v = voice()
    tokens = torch.randint(0, 6561, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for batch in WHOLE_BATCHES:
        _, first_ms = timed(lambda b=batch: whole_clip(flow, v, tokens, b))
        _, again_ms = timed(lambda b=batch: whole_clip(flow, v, tokens, b))
        emit(
            {
                "check": "whole_clips_past_the_buckets",
                "batch": batch,
                "tokens": TOKENS,
                "first_call_s": round(first_ms / 1000, 1),
                "again_ms": round(again_ms, 1),
            }
        )
    # The whole clips' kind (past the buckets) is compiled too; no bucket ran it, so none is captured
    # again (compiling.py).
    started = time.perf_counter()
    COMPILER.wait()
    seconds = round(time.perf_counter() - started, 1)
    recaptured = getattr(graphed, "recaptured", None)
    emit({"check": "settled", "kinds": COMPILER.compiled, "seconds": seconds, "recaptured": recaptured})


if __name__ == "__main__":
    main()
