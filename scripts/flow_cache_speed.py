"""The streaming flow on a CUDA device, CosyVoice2-0.5B sizes with random weights: recompute against
incremental (engine/token2wav/flow_cache.py). Prints JSON lines and writes them to the file given.

    PYTHONPATH=$PWD python scripts/flow_cache_speed.py [out.json]

For B streams of one sentence each (3 s prompt, 260 tokens, upstream's hop schedule 25 + pad, 50,
100, 100, rest), every chunk call of the schedule is timed both ways, fp16 autocast, eager:
- recompute: each call re-runs the flow over prompt + every token so far (as upstream);
- incremental: each call computes only its new frames, the streams starting from their voice's
  shared prompt pages.
The fp16 paths run as served: the flow's Linear and Conv1d weights stored in float16
(engine/token2wav/precision.py), under fp16 autocast. Also: achieved TFLOP/s per call (torch's
FlopCounterMode), the accuracy of each path against float32 recompute, and how far the chunk-masked
incremental final chunk is from upstream's full-attention one.

scripts/flow_compile_speed.py measures the flow compiled against eager on the same schedule.

FLOW_CACHE_INPUTS=1: pools of attention inputs (--flow-cache-inputs); FLOW_CACHE_BATCHES=1,64: those.
FLOW_CACHE_ROW_BUCKETS=1,2,4,8,16,24,32,48,64: the graphed calls' row buckets instead of the engine's
(flow_cache.BATCH_BUCKETS), to weigh the padding of a call to its bucket; FLOW_CACHE_PAST_BUCKETS the
same for the past pages (flow_cache.PAST_BUCKETS). FLOW_CACHE_STEP_GRAPHS=1: only the incremental
calls, eager against graphs of the whole call and graphs of one Euler step (--flow-step-graphs):
each way's captures timed, every call timed and compared with eager.
"""

import copy
import json
import os
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from cosyapp.engine.token2wav import flow_cache
from cosyapp.engine.token2wav.chunking import ChunkSchedule
from cosyapp.engine.token2wav.flow_cache import FlowItem, IncrementalFlow, raw_estimator
from cosyapp.engine.token2wav.pages import FlowCache, KVPool, voice_frames
from cosyapp.engine.token2wav.precision import cast_matmul_weights
from cosyapp.models.flow import CausalMaskedDiffWithXvec

# FLOW_CACHE_SMOKE=1: a quick run of every path on the CPU (no timing value), to check the script.
SMOKE = os.environ.get("FLOW_CACHE_SMOKE") == "1"
DEVICE = torch.device("cpu" if SMOKE else "cuda")
PROMPT, TOKENS, LOOKAHEAD = 75, 60 if SMOKE else 260, 3
INPUTS = os.environ.get("FLOW_CACHE_INPUTS") == "1"
STEP_GRAPHS = os.environ.get("FLOW_CACHE_STEP_GRAPHS") == "1"
BATCHES = (1, 2) if SMOKE else (1, 4, 16, 32, 64)
if os.environ.get("FLOW_CACHE_BATCHES"):
    BATCHES = tuple(int(b) for b in os.environ["FLOW_CACHE_BATCHES"].split(","))
if os.environ.get("FLOW_CACHE_ROW_BUCKETS"):
    flow_cache.BATCH_BUCKETS = tuple(int(b) for b in os.environ["FLOW_CACHE_ROW_BUCKETS"].split(","))
if os.environ.get("FLOW_CACHE_PAST_BUCKETS"):
    flow_cache.PAST_BUCKETS = tuple(int(b) for b in os.environ["FLOW_CACHE_PAST_BUCKETS"].split(","))


def autocast():
    return torch.autocast(DEVICE.type, dtype=torch.float16, enabled=not SMOKE)


def sync():
    """Waits for this thread's stream, as the engine does: a device-wide synchronise is an error
    while the compile thread captures graphs (it recaptures them after each compile)."""
    if DEVICE.type == "cuda":
        torch.cuda.current_stream().synchronize()


def schedule(prompt_len: int, total: int) -> list[tuple[int, bool]]:
    """(tokens handed over, final) per call of one stream, as the worker makes them."""
    chunks = ChunkSchedule(prompt_len)
    calls = []
    while chunks.ready(total):
        calls.append((chunks.advance()[1] + LOOKAHEAD, False))
    return [*calls, (total, True)]


def voice(seed: int = 0, device: torch.device = DEVICE):
    """A 3 s prompt's speech tokens, mel and x-vector on ``device``."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 6561, (PROMPT,), generator=g).to(device),
        (torch.randn(2 * PROMPT, 80, generator=g) - 5).to(device),
        torch.randn(192, generator=g).to(device),
    )


def recompute(flow, v, tokens: torch.Tensor, batch: int, final: bool, streaming: bool = True, fp16=True):
    """``batch`` streams of the voice ``v`` and ``tokens`` through the flow in one call (the recompute
    path), on the tokens' device: fp16 autocast on a GPU."""
    speech, feat, emb = v
    dev = tokens.device
    full = lambda n: torch.full((batch,), n, device=dev)  # noqa: E731
    fp16 = fp16 and dev.type == "cuda"
    with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.float16, enabled=fp16):
        mel, _ = flow.inference(
            token=tokens.expand(batch, -1),
            token_len=full(tokens.numel()),
            prompt_token=speech.expand(batch, -1),
            prompt_token_len=full(PROMPT),
            prompt_feat=feat.expand(batch, -1, -1),
            prompt_feat_len=full(2 * PROMPT),
            embedding=emb.expand(batch, -1),
            streaming=streaming,
            finalize=final,
        )
    return mel


def timed(fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - start) * 1000


def flops(fn) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def start_caches(flow, pool, v, batch: int) -> list[FlowCache]:
    speech, feat, emb = v
    seed = FlowCache()
    prompt_item = FlowItem(seed, speech, feat, emb, speech[:0], False, voice_frames(PROMPT, 25, 3, 2))
    with autocast():
        IncrementalFlow(flow, pool)([prompt_item])
    caches = []
    for _ in range(batch):
        pool.retain(seed.pages)
        caches.append(FlowCache(list(seed.pages), seed.tails.clone(), seed.frames))
    pool.release(seed.pages)
    return caches


def incremental(flow, pool, v, caches, tokens, final):
    speech, feat, emb = v
    items = [FlowItem(c, speech, feat, emb, tokens, final) for c in caches]
    with autocast():
        return IncrementalFlow(flow, pool)(items)


def relative(a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = (a.float() - b.float()).abs()
    return {
        "max_abs": diff.max().item(),
        "rms_rel": (diff.pow(2).mean() / b.float().pow(2).mean()).sqrt().item(),
    }


def recorder(out: str):
    """``emit(row)``: prints the row and rewrites ``out`` with every row so far (a run cut short
    keeps them), under the device's name and torch's version."""
    rows = []
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)

    return emit


def setup(out: str) -> tuple:
    """(flow in float32, served flow, voice, tokens, calls, emit): what both speed scripts start from;
    ``emit`` prints a row and rewrites ``out`` with every row so far (a run cut short keeps them)."""
    torch.manual_seed(0)
    flow = CausalMaskedDiffWithXvec().to(DEVICE).eval()
    page_bytes = KVPool.page_bytes(raw_estimator(flow), flow.decoder.n_timesteps, torch.float16, INPUTS)
    emit = recorder(out)
    served = copy.deepcopy(flow)  # the fp16 paths' flow; `flow` keeps float32 for the references
    if not SMOKE:
        cast_matmul_weights(served, torch.float16)
    v = voice()
    tokens = torch.randint(0, 6561, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    calls = schedule(PROMPT, TOKENS)
    emit({"check": "setup", "page_bytes": page_bytes, "calls": calls, "attention_inputs": INPUTS})
    return flow, served, v, tokens, calls, emit


@torch.inference_mode()
def main() -> None:
    flow, served, v, tokens, calls, emit = setup(
        sys.argv[1] if len(sys.argv) > 1 else "flow-cache-speed.json"
    )
    if not STEP_GRAPHS:
        accuracy(flow, served, v, tokens, calls, emit)
    for batch in BATCHES:
        (compare_graphs if STEP_GRAPHS else measure_batch)(served, v, tokens, calls, batch, emit)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


def accuracy(flow, served, v, tokens, calls, emit) -> None:
    """One stream: incremental fp16 (``served``) and fp32 (``flow``) against recompute fp32, chunk
    by chunk."""
    est = raw_estimator(flow)
    pool32 = KVPool(est, pages=24, steps=10, device=DEVICE, dtype=torch.float32, inputs=INPUTS)
    pool16 = KVPool(est, pages=24, steps=10, device=DEVICE, dtype=torch.float16, inputs=INPUTS)
    c32, c16 = FlowCache(), FlowCache()
    for n, final in calls:
        want = recompute(flow, v, tokens[:n], 1, final, fp16=False)[0]
        [(m32, s32)] = IncrementalFlow(flow, pool32)([FlowItem(c32, *v, tokens[:n], final)])
        with autocast():
            [(m16, s16)] = IncrementalFlow(served, pool16)([FlowItem(c16, *v, tokens[:n], final)])
        cut = lambda m, s: m[:, max(0, 2 * PROMPT - s) :]  # noqa: E731
        ref = want[:, max(0, s32 - 2 * PROMPT) :]
        row = {"check": "accuracy", "tokens": n, "final": final}
        row["incremental_fp32_vs_recompute_fp32"] = relative(cut(m32, s32), ref)
        row["incremental_fp16_vs_recompute_fp32"] = relative(cut(m16, s16), ref)
        if final:
            # Upstream's last call attends over everything (non-streaming masks).
            upstream = recompute(flow, v, tokens[:n], 1, True, streaming=False, fp16=False)[0]
            row["chunk_masked_final_vs_full_attention_final"] = relative(
                cut(m32, s32), upstream[:, -ref.shape[1] :]
            )
            row["full_attention_final_frames"] = ref.shape[1]
        emit(row)
    pool32.release(c32.pages), pool16.release(c16.pages)


def run_schedule(flow, pool, runner, v, batch, tokens, calls, timings: list | None = None):
    """One sentence for `batch` streams from the voice's pages, call by call; returns the first
    stream's frames of each call."""
    caches = start_caches(flow, pool, v, batch)
    speech, feat, emb = v
    frames = []
    for n, final in calls:
        items = [FlowItem(c, speech, feat, emb, tokens[:n], final) for c in caches]
        with autocast():
            result, ms = timed(lambda: runner(items))  # noqa: B023
        assert result is not None, "pool too small"
        frames.append(result[0][0])
        if timings is not None:
            timings.append(ms)
    for c in caches:
        pool.release(c.pages)
    return frames


def capture_missed(runner: IncrementalFlow) -> None:
    """Capture the buckets the runner's calls met (the worker has a thread for it)."""
    if runner.graphs is not None and DEVICE.type == "cuda":
        while runner.graphs.capture_missed():
            pass
    sync()


def incremental_flops(flow, pool, v, tokens, calls, i: int) -> float:
    """FLOPs of one stream's call ``i`` of the schedule."""
    probe = start_caches(flow, pool, v, 1)
    for m, f in calls[:i]:  # bring one stream to this call, then count the call's FLOPs
        incremental(flow, pool, v, probe, tokens[:m], f)
    n, final = calls[i]
    count = flops(lambda: incremental(flow, pool, v, probe, tokens[:n], final))
    pool.release(probe[0].pages)
    return count


def measure_batch(flow, v, tokens, calls, batch: int, emit) -> None:
    """Every call of the schedule for `batch` streams: recompute, incremental eager and graphed."""
    est = raw_estimator(flow)
    pages = batch * (2 * (PROMPT + TOKENS) // 50 + 1) + 4
    pool = KVPool(est, pages=pages, steps=10, device=DEVICE, dtype=torch.float16, inputs=INPUTS)
    eager_ms, graphed_ms = [], []
    eager_runner, graphed_runner = IncrementalFlow(flow, pool), IncrementalFlow(flow, pool, graphs=True)
    run_schedule(flow, pool, eager_runner, v, batch, tokens, calls)  # kernels, allocator
    eager = run_schedule(flow, pool, eager_runner, v, batch, tokens, calls, timings=eager_ms)
    started = time.perf_counter()
    run_schedule(flow, pool, graphed_runner, v, batch, tokens, calls)  # meets this batch's buckets
    capture_missed(graphed_runner)
    capture_s = time.perf_counter() - started
    graphed = run_schedule(flow, pool, graphed_runner, v, batch, tokens, calls, timings=graphed_ms)
    rec_total = 0.0
    for i, (n, final) in enumerate(calls):
        recompute(flow, v, tokens[:n], batch, final)  # warm-up of this shape
        _, rec_ms = timed(lambda: recompute(flow, v, tokens[:n], batch, final))  # noqa: B023
        rec_flops = flops(lambda: recompute(flow, v, tokens[:n], batch, final))  # noqa: B023
        inc_flops = batch * incremental_flops(flow, pool, v, tokens, calls, i)
        rec_total += rec_ms
        emit(
            {
                "check": "speed",
                "batch": batch,
                "tokens": n,
                "final": final,
                "new_frames": eager[i].shape[1],
                "recompute_frames": 2 * (PROMPT + n - (0 if final else LOOKAHEAD)),
                "recompute_ms": round(rec_ms, 2),
                "incremental_eager_ms": round(eager_ms[i], 2),
                "incremental_graphed_ms": round(graphed_ms[i], 2),
                "graphed_vs_eager_max_abs": (graphed[i].float() - eager[i].float()).abs().max().item(),
                "recompute_tflops": round(rec_flops / rec_ms / 1e9, 1),
                "incremental_eager_tflops": round(inc_flops / eager_ms[i] / 1e9, 1),
                "incremental_graphed_tflops": round(inc_flops / graphed_ms[i] / 1e9, 1),
            }
        )
    audio_s = batch * TOKENS / 25
    totals = {
        "recompute": rec_total,
        "incremental_eager": sum(eager_ms),
        "incremental_graphed": sum(graphed_ms),
    }
    emit(
        {
            "check": "sentence",
            "batch": batch,
            **{f"{k}_ms": round(x, 1) for k, x in totals.items()},
            **{f"{k}_audio_s_per_s": round(audio_s / x * 1000, 1) for k, x in totals.items()},
            "graph_capture_s": round(capture_s, 1),
            "page_gb": round(pages * KVPool.page_bytes(est, 10, torch.float16, INPUTS) / 2**30, 1),
        }
    )


def compare_graphs(flow, v, tokens, calls, batch: int, emit) -> None:
    """Every incremental call of the schedule for ``batch`` streams: eager, replayed from graphs of
    the whole call, and from graphs of one Euler step; the captures of each way timed."""
    est = raw_estimator(flow)
    pages = batch * (2 * (PROMPT + TOKENS) // 50 + 1) + 4
    pool = KVPool(est, pages=pages, steps=10, device=DEVICE, dtype=torch.float16, inputs=INPUTS)
    runners = {
        "eager": IncrementalFlow(flow, pool),
        "call_graphs": IncrementalFlow(flow, pool, graphs=True),
        "step_graphs": IncrementalFlow(flow, pool, graphs=True, step_graphs=True),
    }
    row: dict = {"check": "graphs", "batch": batch, "calls": [n for n, _ in calls]}
    frames = {}
    for name, runner in runners.items():
        run_schedule(flow, pool, runner, v, batch, tokens, calls)  # kernels, allocator; buckets met
        capture_missed(runner)
        if runner.graphs is not None:
            row[f"{name}_captures"] = runner.graphs.captures
            row[f"{name}_capture_s"] = round(runner.graphs.capture_seconds, 2)
        eager_before = runner.graphs.eager_calls if runner.graphs is not None else 0
        timings: list[float] = []
        frames[name] = run_schedule(flow, pool, runner, v, batch, tokens, calls, timings=timings)
        row[f"{name}_ms"] = [round(ms, 2) for ms in timings]
        row[f"{name}_sentence_ms"] = round(sum(timings), 1)
        if runner.graphs is not None:  # timed calls that found no graph (none once all are captured)
            row[f"{name}_timed_eager_calls"] = runner.graphs.eager_calls - eager_before
    for name in ("call_graphs", "step_graphs"):
        pairs = zip(frames[name], frames["eager"], strict=True)
        row[f"{name}_vs_eager_max_abs"] = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    emit(row)


def whole_clip(flow, v, tokens, batch: int) -> torch.Tensor:
    return recompute(flow, v, tokens, batch, True, streaming=False)


if __name__ == "__main__":
    main()
