"""The flow compiled by torch.compile against eager on a CUDA device, CosyVoice2-0.5B sizes with
random weights, both replayed from CUDA graphs as served, fp16. Prints JSON lines and writes them to
the file given.

    PYTHONPATH=$PWD python scripts/flow_compile_speed.py [out.json]

At batch 1, 16 and 64 (FLOW_CACHE_BATCHES): a whole clip (recompute path, full attention) and every
incremental chunk call of flow_cache_speed.py's schedule: ms per call, TFLOP/s, the largest
difference compiled against eager (fp16), and the first calls' time, which holds the compile
(inductor's cache starts empty unless TORCHINDUCTOR_CACHE_DIR is set).

FLOW_CACHE_COMPILE_SCOPE: serve (default; what --compile-flow compiles, engine/token2wav/fused.py:
the estimator's forward whole and its pieces for the incremental flow), blocks (the same, the
incremental step's transformer blocks compiled whole too, compiled_blocks.py, which needs
FLOW_CACHE_INPUTS=1; measured slower than eager on an H100, not served) or step: the forward whole
and the incremental flow's step whole too (pool reads and writes included, docs/model.md §8.7; on
an H100 its graph did not finish compiling in 7 minutes).
FLOW_CACHE_COMPILE_MODE=max-autotune-no-cudagraphs: compile in that torch.compile mode (matrix
products as autotuned Triton templates with the pointwise work after them fused in, where faster).
FLOW_CACHE_INPUTS=1, FLOW_CACHE_SMOKE=1: as flow_cache_speed.py.
"""

import copy
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from flow_cache_speed import (  # noqa: E402  (the sibling script's schedule and helpers)
    DEVICE,
    INPUTS,
    PROMPT,
    SMOKE,
    TOKENS,
    capture_missed,
    flops,
    incremental_flops,
    run_schedule,
    setup,
    timed,
    whole_clip,
)

from cosyapp.engine.token2wav.compiled_blocks import compile_blocks  # noqa: E402
from cosyapp.engine.token2wav.flow_cache import IncrementalFlow, raw_estimator  # noqa: E402
from cosyapp.engine.token2wav.fused import fuse_estimator, use_cache_dir  # noqa: E402
from cosyapp.engine.token2wav.graphs import GraphedEstimator  # noqa: E402
from cosyapp.engine.token2wav.pages import KVPool  # noqa: E402

COMPILE_MODE = os.environ.get("FLOW_CACHE_COMPILE_MODE") or None
COMPILE_SCOPE = os.environ.get("FLOW_CACHE_COMPILE_SCOPE", "serve")
BATCHES = (1, 2) if SMOKE else (1, 16, 64)
if os.environ.get("FLOW_CACHE_BATCHES"):
    BATCHES = tuple(int(b) for b in os.environ["FLOW_CACHE_BATCHES"].split(","))


@torch.inference_mode()
def main() -> None:
    _, served, v, tokens, calls, emit = setup(sys.argv[1] if len(sys.argv) > 1 else "flow-compile-speed.json")
    compare_compiled(served, v, tokens, calls, emit)


def graphed_copies(flow) -> tuple:
    """(eager, compiled) copies of ``flow``, each estimator replayed from CUDA graphs, and the
    compiled copy's inductor cache folder (a new one, unless TORCHINDUCTOR_CACHE_DIR is set)."""
    eager, compiled = copy.deepcopy(flow), copy.deepcopy(flow)
    cache = Path(tempfile.mkdtemp(prefix="inductor-"))
    if COMPILE_SCOPE == "step":
        use_cache_dir(cache)
        est = compiled.decoder.estimator
        est.forward = torch.compile(type(est).forward.__get__(est), dynamic=True, mode=COMPILE_MODE)
    else:
        fuse_estimator(compiled.decoder.estimator, cache, mode=COMPILE_MODE)
    for f in (eager, compiled):
        f.decoder.estimator = GraphedEstimator(f.decoder.estimator)
    return eager, compiled, os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compare_compiled(flow, v, tokens, calls, emit) -> None:
    """Eager against compiled, both graphed: a whole clip and every chunk call, per batch size."""
    eager, compiled, cache = graphed_copies(flow)
    emit(
        {
            "check": "compile_setup",
            "inductor_cache": cache,
            "mode": COMPILE_MODE or "default",
            "scope": COMPILE_SCOPE,
        }
    )
    flows = {"eager": eager, "compiled": compiled}
    for batch in BATCHES:
        clip = {name: functools.partial(whole_clip, f, v, tokens, batch) for name, f in flows.items()}
        first_s = {name: timed(fn)[1] / 1000 for name, fn in clip.items()}  # compiles, captures
        ms = {name: mean_ms(fn) for name, fn in clip.items()}
        work = flops(functools.partial(whole_clip, flow, v, tokens, batch))
        emit(
            {
                "check": "compile_whole_clip",
                "batch": batch,
                "tokens": len(tokens),
                **{f"{k}_first_call_s": round(x, 1) for k, x in first_s.items()},
                **{f"{k}_ms": round(x, 2) for k, x in ms.items()},
                **{f"{k}_tflops": round(work / x / 1e9, 1) for k, x in ms.items()},
                "compiled_vs_eager_max_abs": (clip["compiled"]() - clip["eager"]()).abs().max().item(),
            }
        )
        compare_incremental(flow, eager, compiled, v, tokens, calls, batch, emit)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


def compare_incremental(flow, eager, compiled, v, tokens, calls, batch: int, emit) -> None:
    """Every chunk call of the schedule for ``batch`` streams, eager against compiled, both graphed."""
    est = raw_estimator(flow)
    pages = batch * (2 * (PROMPT + TOKENS) // 50 + 1) + 4
    pool = KVPool(est, pages=pages, steps=10, device=DEVICE, dtype=torch.float16, inputs=INPUTS)
    runners = {
        name: IncrementalFlow(f, pool, graphs=True) for name, f in (("eager", eager), ("compiled", compiled))
    }
    if COMPILE_SCOPE == "step":
        compile_step(runners["compiled"])
    if COMPILE_SCOPE == "blocks":
        compile_blocks(runners["compiled"].step_fn, mode=COMPILE_MODE)
    first_s, timings, frames, unreplayed = {}, {}, {}, {}
    for name, runner in runners.items():
        started = time.perf_counter()
        # Compiles, meets the buckets: these calls run eagerly, their graphs are captured after.
        unreplayed[name] = run_schedule(flow, pool, runner, v, batch, tokens, calls)
        capture_missed(runner)
        first_s[name] = time.perf_counter() - started
        timings[name] = []
        frames[name] = run_schedule(flow, pool, runner, v, batch, tokens, calls, timings=timings[name])
    for i, (n, final) in enumerate(calls):
        work = batch * incremental_flops(flow, pool, v, tokens, calls, i)
        ms = {name: t[i] for name, t in timings.items()}
        emit(
            {
                "check": "compile_incremental_call",
                "batch": batch,
                "tokens": n,
                "final": final,
                "new_frames": frames["eager"][i].shape[1],
                **{f"{k}_ms": round(x, 2) for k, x in ms.items()},
                **{f"{k}_tflops": round(work / x / 1e9, 1) for k, x in ms.items()},
                "compiled_vs_eager_max_abs": (frames["compiled"][i] - frames["eager"][i]).abs().max().item(),
                # The deferred capture: a bucket's replayed graph against its first, eager call.
                "replayed_vs_first_call_max_abs": max(
                    (frames[k][i] - unreplayed[k][i]).abs().max().item() for k in frames
                ),
            }
        )
    emit(
        {
            "check": "compile_incremental_sentence",
            "batch": batch,
            **{f"{k}_ms": round(sum(t), 1) for k, t in timings.items()},
            **{f"{k}_first_sentence_s": round(x, 1) for k, x in first_s.items()},
        }
    )


def compile_step(runner: IncrementalFlow) -> None:
    """The runner's estimator step (what its CUDA graphs capture too) as one compiled graph."""
    step = torch.compile(runner.step_fn.__call__, dynamic=True, mode=COMPILE_MODE)
    runner.step_fn = step
    if runner.graphs is not None:
        runner.graphs.step_fn = step


def mean_ms(fn, repeats: int = 3) -> float:
    return timed(lambda: [fn() for _ in range(repeats)])[1] / repeats


if __name__ == "__main__":
    main()
