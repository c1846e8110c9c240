"""Where the incremental streaming flow's GPU time goes, kernel by kernel (CosyVoice2-0.5B sizes,
random weights). Prints JSON lines and writes them to the file given.

    PYTHONPATH=$PWD python scripts/flow_profile.py [out.json]

For B streams of one 260-token sentence (3 s prompt, the worker's chunk schedule), each chunk call
of engine/token2wav/flow_cache.py is run eagerly under torch.profiler: CUDA kernel time and kernel
count per category (GEMM, attention, convolution, LayerNorm, elementwise, copies and indexing,
casts) and the top kernels by time. Each call is also timed replayed from its CUDA graph, so the
gap between the graphed wall time and the kernels' own time shows what launches cost.

The flow's Linear and Conv1d weights are stored in float16 as the server stores them
(engine/token2wav/precision.py); FLOW_PROFILE_FP32_WEIGHTS=1 keeps them float32, so autocast casts
them on every call. FLOW_PROFILE_BATCHES=1,64 picks the batch sizes (empty: none);
FLOW_PROFILE_GRAPHED=0 leaves out the graphed timing (and its captures' memory). FLOW_CACHE_INPUTS=1: the pool
keeps attention inputs instead of keys and values (--flow-cache-inputs).
FLOW_PROFILE_WHOLE=23,64 also profiles whole clips (the recompute path, full attention, eagerly as
the worker runs calls past the graphs' largest bucket) for that many requests at once: wall time,
TFLOP/s (torch's FlopCounterMode) and the same kernel categories, under each variant of
FLOW_PROFILE_WHOLE_VARIANTS (default all: the dense attention mask against none, each SDPA backend,
the estimator's pieces compiled as --compile-flow does, with and without guard evaluation, and the
whole estimator step compiled as one graph; both compiled again in torch.compile's
max-autotune-no-cudagraphs mode; and the LayerNorms reading and writing float16).
"""

import collections
import contextlib
import functools
import inspect
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from flow_cache_speed import (  # noqa: E402  (the sibling script's schedule and helpers)
    DEVICE,
    INPUTS,
    PROMPT,
    TOKENS,
    autocast,
    capture_missed,
    flops,
    schedule,
    start_caches,
    sync,
    timed,
    voice,
    whole_clip,
)

from cosyapp.bench.timeline import category  # noqa: E402  (the kernel categories' one table)
from cosyapp.engine.token2wav.flow_cache import FlowItem, IncrementalFlow, raw_estimator  # noqa: E402
from cosyapp.engine.token2wav.fused import PIECES as FUSED_PIECES  # noqa: E402
from cosyapp.engine.token2wav.fused import fuse_estimator  # noqa: E402
from cosyapp.engine.token2wav.pages import KVPool  # noqa: E402
from cosyapp.engine.token2wav.precision import cast_matmul_weights  # noqa: E402
from cosyapp.models.flow import CausalMaskedDiffWithXvec  # noqa: E402

BATCHES = tuple(int(b) for b in os.environ.get("FLOW_PROFILE_BATCHES", "1,16,64").split(",") if b)
WHOLE = tuple(int(b) for b in os.environ.get("FLOW_PROFILE_WHOLE", "").split(",") if b)
GRAPHED = os.environ.get("FLOW_PROFILE_GRAPHED") != "0"
CAST = os.environ.get("FLOW_PROFILE_FP32_WEIGHTS") != "1" and DEVICE.type == "cuda"


def kernels(prof) -> list[tuple[str, float]]:
    """(name, microseconds) of every CUDA kernel the profile saw."""
    out = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA or DEVICE.type == "cpu":
            us = event.device_time if DEVICE.type == "cuda" else event.self_cpu_time_total
            out.append((event.name, us))
    return out


def summarise(found: list[tuple[str, float]]) -> dict:
    by_cat = collections.defaultdict(lambda: [0.0, 0])
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for name, us in found:
        for table, key in ((by_cat, category(name)), (by_name, name)):
            table[key][0] += us
            table[key][1] += 1
    total = sum(us for _, us in found) or 1.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "kernel_ms": round(total / 1000, 2),
        "kernels": len(found),
        "categories": {
            k: {"ms": round(v[0] / 1000, 2), "share": round(v[0] / total, 3), "count": v[1]}
            for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1][0])
        },
        "top": [{"name": k[:140], "ms": round(v[0] / 1000, 2), "count": v[1]} for k, v in top],
    }


def measure(flow, v, tokens, calls, batch: int, emit) -> None:
    """Every chunk call of one sentence for ``batch`` streams: graphed wall time, eager kernels."""
    speech, feat, emb = v
    pages = batch * (2 * (PROMPT + TOKENS) // 50 + 1) + 4
    pool = KVPool(
        raw_estimator(flow), pages=pages, steps=10, device=DEVICE, dtype=torch.float16, inputs=INPUTS
    )
    eager, graphed = IncrementalFlow(flow, pool), IncrementalFlow(flow, pool, graphs=True)

    def sentence(runner, each=None):
        caches = start_caches(flow, pool, v, batch)
        for i, (n, final) in enumerate(calls):
            items = [FlowItem(c, speech, feat, emb, tokens[:n], final) for c in caches]
            with autocast():
                if each is None:
                    runner(items)
                else:
                    each(i, lambda: runner(items))  # noqa: B023
        for c in caches:
            pool.release(c.pages)

    sentence(eager)  # kernels, allocator
    graphed_ms, profiles = {}, {}

    def time_call(i, fn):
        graphed_ms[i] = timed(fn)[1]

    def profile_call(i, fn):
        profiles[i] = profiled(fn)

    if GRAPHED:
        sentence(graphed)  # meets the buckets
        capture_missed(graphed)
        sentence(graphed, time_call)
    sentence(eager, profile_call)
    for i, (n, final) in enumerate(calls):
        summary, wall = profiles[i]
        emit(
            {
                "batch": batch,
                "tokens": n,
                "final": final,
                "graphed_ms": round(graphed_ms[i], 2) if GRAPHED else None,
                "eager_profiled_wall_ms": round(wall, 2),
                **summary,
            }
        )


def profiled(fn) -> tuple[dict, float]:
    """``fn()`` under the profiler: its kernels summarised, and its wall time (ms) as profiled."""
    sync()
    start = time.perf_counter()
    activity = ProfilerActivity.CUDA if DEVICE.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        fn()
        sync()
    return summarise(kernels(prof)), (time.perf_counter() - start) * 1000


def measure_whole(flow, v, tokens, batch: int, emit, variants: dict) -> None:
    """``batch`` whole clips in one eager flow call, under each of ``variants`` (name -> context
    manager factory): wall time, TFLOP/s, largest difference to the first variant's mel, and kernels
    by category for the first two."""
    run = functools.partial(whole_clip, flow, v, tokens, batch)
    work = flops(run)
    first = None
    for i, (name, variant) in enumerate(variants.items()):
        with variant():
            mel, first_ms = timed(run)  # kernels, allocator, compilation
            wall_ms = min(timed(run)[1] for _ in range(3))
            summary = profiled(run)[0] if i < 2 else {}
        first = mel if first is None else first
        emit(
            {
                "whole_batch": batch,
                "variant": name,
                "tokens": TOKENS,
                "eager_ms": round(wall_ms, 2),
                "first_call_s": round(first_ms / 1000, 1),
                "tflops": round(work / wall_ms / 1e9, 1),
                "max_abs_diff_to_first": float((mel.float() - first.float()).abs().max()),
                **summary,
            }
        )


def whole_variants(flow) -> dict:
    """The whole-clip variants FLOW_PROFILE_WHOLE_VARIANTS names (default: all of them)."""
    est = raw_estimator(flow)

    @contextlib.contextmanager
    def patched(**changes):
        """The estimator called with some of its keyword arguments replaced."""
        forward = est.forward
        signature = inspect.signature(forward)

        def replaced(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            return forward(**{**bound.arguments, **changes})

        est.forward = replaced
        try:
            yield
        finally:
            del est.forward

    def backend(kind):
        return lambda: torch.nn.attention.sdpa_kernel([kind])

    autotune = "max-autotune-no-cudagraphs"

    @contextlib.contextmanager
    def compiled(skip_guards: bool, mode: str | None = None):
        fuse_estimator(est, mode=mode)
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip_guards):
                yield
        finally:
            for module in est.modules():
                for _, name in FUSED_PIECES:
                    module.__dict__.pop(name, None)

    @contextlib.contextmanager
    def compiled_forward(mode: str | None = None):
        """The whole estimator step as one compiled graph (one guard check per Euler step)."""
        est.forward = torch.compile(type(est).forward.__get__(est), dynamic=True, mode=mode)
        try:
            yield
        finally:
            del est.forward

    @contextlib.contextmanager
    def half_layer_norms():
        """Each LayerNorm reads and writes float16 (its statistics still in float32, inside the
        kernel) instead of autocast's float32 output: the casts around it and half its bytes go. Its
        weights are cast once here, so this is a timing experiment, not the served numerics."""
        norms = [m for m in est.modules() if isinstance(m, torch.nn.LayerNorm)]
        kept = [(m.weight.data, m.bias.data) for m in norms]
        for m in norms:
            m.weight.data, m.bias.data = m.weight.data.half(), m.bias.data.half()

        def forward(self, x):
            # float16 under the GPU's autocast; without one (the CPU smoke run) back to x's dtype
            out = torch.float16 if torch.is_autocast_enabled(DEVICE.type) else x.dtype
            with torch.autocast(DEVICE.type, enabled=False):
                return torch.nn.functional.layer_norm(
                    x.half(), self.normalized_shape, self.weight, self.bias, self.eps
                ).to(out)

        # On the estimator's norms only: the encoder's run in float32 outside autocast.
        for m in norms:
            m.forward = forward.__get__(m)
        try:
            yield
        finally:
            for m, (w, b) in zip(norms, kept, strict=True):
                del m.forward
                m.weight.data, m.bias.data = w, b

    backends = torch.nn.attention.SDPBackend

    @contextlib.contextmanager
    def dense_efficient():
        with patched(all_valid=False), backend(backends.EFFICIENT_ATTENTION)():
            yield

    every = {
        "dense_mask": lambda: patched(all_valid=False),
        "no_mask": contextlib.nullcontext,
        "no_mask_flash": backend(backends.FLASH_ATTENTION),
        "no_mask_cudnn": backend(backends.CUDNN_ATTENTION),
        "no_mask_efficient": backend(backends.EFFICIENT_ATTENTION),
        "dense_mask_efficient": dense_efficient,
        "no_mask_compiled": lambda: compiled(False),
        "no_mask_compiled_skip_guards": lambda: compiled(True),
        "no_mask_compiled_forward": compiled_forward,
        "no_mask_compiled_autotune": lambda: compiled(False, autotune),
        "no_mask_compiled_forward_autotune": lambda: compiled_forward(autotune),
        "no_mask_half_layer_norms": half_layer_norms,
    }

    names = os.environ.get("FLOW_PROFILE_WHOLE_VARIANTS", ",".join(every)).split(",")
    return {name: every[name] for name in names if name}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "flow-profile.json"
    torch.manual_seed(0)
    flow = CausalMaskedDiffWithXvec().to(DEVICE).eval()
    v = voice()
    if CAST:
        cast_matmul_weights(flow, torch.float16)
    rows = []
    meta = {
        "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "matmul_weights": "float16" if CAST else "float32",
        "attention_inputs": INPUTS,
    }

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)

    tokens = torch.randint(0, 6561, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    calls = schedule(PROMPT, TOKENS)
    for batch in BATCHES:
        measure(flow, v, tokens, calls, batch, emit)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    for batch in WHOLE:
        measure_whole(flow, v, tokens, batch, emit, whole_variants(flow))


if __name__ == "__main__":
    main()
