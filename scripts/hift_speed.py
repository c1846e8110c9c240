"""HiFT alone on a CUDA device, CosyVoice2-0.5B sizes with random weights: eager (weight norm fused,
as served) against its Snake activations compiled (engine/token2wav/fused.py fuse_hift), at the
shapes the worker runs. Prints JSON lines and writes them to the file given.

    PYTHONPATH=$PWD python scripts/hift_speed.py [out.json]

Shapes: streaming chunks of 100 and 200 new mel frames (2 and 4 s; the 8 cached frames in front, as
a chunk call after the first has them) and a whole 10.4 s clip (520 frames), at batch 1, 16 and 64
(whole clips at 1 and 16). Per shape: ms per call for each variant (the median of 5 timed calls
after 2 warm-ups), audio seconds per second, the compiled audio's SNR against eager, and the first
compiled call's time (the compile). Then the eager call at batch 16 of 100 frames under
torch.profiler: kernel time by category (convolution, elementwise, FFT, copies), to show what HiFT's
time is made of.

HIFT_SPEED_COLD=1 instead times eager HiFT's first call at each of several batch sizes no call
has run before (a chunk of 100 new frames), against its second call: a new shape may pay for
choosing its convolutions' and FFTs' plans on the host (in an H100 engine run the first chunk's HiFT
took 530-557 ms at 64 streams where the batch size was new to that engine, 67 ms where it was not;
docs/benchmarks/README.md).

HIFT_SPEED_SMOKE=1: every path once on the CPU at batch 1 and 2 (no timing value), to check the script.
"""

import collections
import copy
import functools
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cosyapp.bench.timeline import category
from cosyapp.engine.token2wav.fused import fuse_hift
from cosyapp.models.hift import HiFTGenerator

SMOKE = os.environ.get("HIFT_SPEED_SMOKE") == "1"
DEVICE = torch.device("cpu" if SMOKE else "cuda")
CHUNKS = ((108, (1, 2) if SMOKE else (1, 16, 64)), (208, () if SMOKE else (1, 16, 64)))
WHOLE = (520, (1,) if SMOKE else (1, 16))
CACHED_SOURCE = 3840  # samples of the previous chunk's source a chunk call continues from
COLD = os.environ.get("HIFT_SPEED_COLD") == "1"
COLD_BATCHES = (1, 2) if SMOKE else (1, 3, 5, 7, 13, 21, 37, 61, 64)  # each met for the first time


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def call_ms(fn) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(1 if SMOKE else 5):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - started) * 1000)
    return sorted(times)[len(times) // 2]


def snr_db(test: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (test.double() - ref.double()).pow(2).mean().clamp(min=1e-30)
    return (10 * torch.log10(ref.double().pow(2).mean() / noise)).item()


def inputs(batch: int, frames: int, streaming: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mel = (torch.randn(batch, 80, frames, generator=g) * 2 - 5).to(DEVICE)
    cache = torch.randn(batch, 1, CACHED_SOURCE, generator=g).to(DEVICE) * 0.1 if streaming else None
    return mel, cache


def vocode(hift, mel, cache):
    gens = [torch.Generator(DEVICE).manual_seed(i) for i in range(mel.size(0))]
    return hift(mel, cache, generators=gens)[0]


def profiled(fn) -> dict:
    """Kernel time by category and the top kernels of one call (CUDA only)."""
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) or 1.0
    by_cat, by_name = collections.Counter(), collections.Counter()
    counts = collections.Counter()
    for e in kernels:
        by_cat[category(e.name)] += e.device_time
        counts[category(e.name)] += 1
        by_name[e.name[:90]] += e.device_time
    return {
        "kernel_ms": round(total / 1000, 2),
        "kernels": len(kernels),
        "categories": {
            k: {"ms": round(v / 1000, 2), "share": round(v / total, 3), "count": counts[k]}
            for k, v in by_cat.most_common()
        },
        "top": [[name, round(t / 1000, 2)] for name, t in by_name.most_common(12)],
    }


@torch.inference_mode()
def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "hift-speed.json"
    torch.manual_seed(0)
    eager = HiFTGenerator().to(DEVICE).eval()
    eager.fuse_weight_norm()
    compiled = copy.deepcopy(eager)
    fuse_hift(compiled)
    snakes = sum(type(m).__name__ == "Snake" for m in compiled.modules())
    rows = []

    def emit(row: dict) -> None:  # the file is rewritten each row: a run cut short keeps its rows
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(out, "w") as f:
            device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
            json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)

    emit({"check": "setup", "snakes": snakes})
    if COLD:
        cold_shapes(eager, emit)
        return
    first_compiled = True
    for frames, batches, streaming in (*((f, b, True) for f, b in CHUNKS), (*WHOLE, False)):
        for batch in batches:
            mel, cache = inputs(batch, frames, streaming)
            started = time.perf_counter()
            got = vocode(compiled, mel, cache)
            sync()
            first_s = time.perf_counter() - started
            want = vocode(eager, mel, cache)
            ms = {
                name: call_ms(functools.partial(vocode, h, mel, cache))
                for name, h in (("eager", eager), ("compiled", compiled))
            }
            audio_s = batch * want.size(1) / 24_000
            emit(
                {
                    "check": "speed",
                    "streaming": streaming,
                    "batch": batch,
                    "mel_frames": frames,
                    "audio_s": round(audio_s, 2),
                    **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                    **{f"{k}_audio_s_per_s": round(audio_s / v * 1000, 1) for k, v in ms.items()},
                    "compiled_vs_eager_snr_db": round(snr_db(got, want), 1),
                    "compiled_vs_eager_max_abs": (got - want).abs().max().item(),
                    "first_compiled_call_s": round(first_s, 1),
                    "first_compile": first_compiled,
                }
            )
            first_compiled = False
    if DEVICE.type == "cuda":
        mel, cache = inputs(16, 108, True)
        for name, h in (("eager", eager), ("compiled", compiled)):
            emit(
                {
                    "check": "profile",
                    "variant": name,
                    "batch": 16,
                    "mel_frames": 108,
                    **profiled(lambda h=h: vocode(h, mel, cache)),
                }
            )


def cold_shapes(hift, emit) -> None:
    """The first call at each batch size in COLD_BATCHES (none run before) against the second."""
    for batch in COLD_BATCHES:
        mel, cache = inputs(batch, 108, True)
        calls = []
        for _ in range(2):
            sync()
            started = time.perf_counter()
            vocode(hift, mel, cache)
            sync()
            calls.append((time.perf_counter() - started) * 1000)
        emit(
            {
                "check": "cold",
                "batch": batch,
                "mel_frames": 108,
                "first_ms": round(calls[0], 2),
                "second_ms": round(calls[1], 2),
            }
        )


if __name__ == "__main__":
    main()
