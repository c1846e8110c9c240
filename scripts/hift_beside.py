"""HiFT's first-chunk call beside a flow call, on a CUDA device, without vLLM: is its launch held?

    PYTHONPATH=$PWD python scripts/hift_beside.py [out.json]

In the engine at 64 streams the first chunk's HiFT call took 500-544 ms to launch its kernels
(``hift_launch``), against 22-37 ms at one stream, and its device work was done by the time the last
launch returned (``hift_wait`` 1-4 ms); alone, a call of 64 chunks takes about 100 ms (eager, H100).
This script puts the same call beside a flow call in one process, on the worker's CUDA streams
(cuda_streams.role_stream: the flow at priority 0, HiFT one above), to see which neighbour holds
the launches. CosyVoice2-0.5B sizes, random weights; HiFT eager with its weight norm fused (its
Snakes are not compiled here), the flow as served (fp16 weights, fp16 autocast), eagerly.

Per setting, HiFT's call at 64 rows x 108 mel frames (a first chunk with its 8 cached frames) is
timed 5 times: ``launch_ms`` (the call returned: every kernel launched) and ``wait_ms`` (its stream
then synchronised). Settings:
- alone;
- beside the flow: a thread runs the flow's recompute of a first chunk at 64 rows in a loop (about
  400 ms a call);
- beside the flow, HiFT at the flow's priority;
- beside a flood of small kernels (one thread adding to a small tensor, as fast as it launches);
- beside large matrix products (a few long kernels that fill the device);
- beside another process that runs steps of small products in a loop, as vLLM's engine core does
  in its own process (the device then time-slices between the two processes' contexts), alone and
  with the flow too;
- beside a thread running pure Python (no device work): every torch call lets go of the interpreter
  lock and takes it back, which waits while another thread runs Python.
HIFT_BESIDE_ONLY=TEXT runs only the settings whose name holds TEXT; HIFT_BESIDE_SWITCH_MS sets the
interpreter's switch interval (sys.setswitchinterval; Python's default is 5 ms).
Each setting's last call beside a neighbour is traced (bench/timeline.py): each thread's CUDA calls,
the longest of each API, so a launch held by a full queue (a long cudaLaunchKernel) shows apart from
one held elsewhere. Run it again with CUDA_DEVICE_MAX_CONNECTIONS=32 (CUDA's default is 8 hardware
queues per context, which streams share) to see whether the two streams share one.

HIFT_BESIDE_SMOKE=1: every setting once on the CPU, small (no timing value), to check the script.
"""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from flow_cache_speed import recompute, voice  # noqa: E402  (the sibling script's flow call)

from cosyapp.bench.timeline import Timeline
from cosyapp.engine.cuda_streams import role_stream
from cosyapp.engine.token2wav.precision import cast_matmul_weights
from cosyapp.models.flow import CausalMaskedDiffWithXvec
from cosyapp.models.hift import HiFTGenerator

SMOKE = os.environ.get("HIFT_BESIDE_SMOKE") == "1"
DEVICE = torch.device("cpu" if SMOKE else "cuda")
ROWS = 2 if SMOKE else 64
FRAMES = 108  # a first chunk's mel: 100 new frames and the 8 HiFT caches in front
CACHED_SOURCE = 3840
FIRST_CALL = 28  # a first chunk's 25 tokens and the lookahead, after a 3 s prompt
CALLS = 1 if SMOKE else 5


def stream(role: str, priority: int):
    return contextlib.nullcontext() if SMOKE else torch.cuda.stream(role_stream(role, DEVICE, priority))


def sync() -> None:
    if not SMOKE:
        torch.cuda.current_stream().synchronize()


class Neighbour(threading.Thread):
    """A thread that calls ``work`` on its own CUDA stream until stopped, counting the calls."""

    def __init__(self, name: str, work):
        super().__init__(name=name, daemon=True)
        self.work = work
        self.calls, self.busy = 0, threading.Event()
        self._stop_event = threading.Event()

    def run(self) -> None:
        with torch.inference_mode(), stream(self.name, 0):
            while not self._stop_event.is_set():
                self.work()
                self.calls += 1
                self.busy.set()
            sync()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def flow_work(flow):
    """A first chunk's recompute for ROWS streams (flow_cache_speed.py's)."""
    v = voice(0, DEVICE)
    tokens = torch.randint(0, 6561, (FIRST_CALL,), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def call():
        recompute(flow, v, tokens, ROWS, final=False)
        sync()  # the worker waits for each flow call before handing its mels on

    return call


def small_kernels():
    x = torch.zeros(256, device=DEVICE)

    def call():
        for _ in range(200):
            x.add_(1.0)

    return call


def large_products():
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.float16 if not SMOKE else torch.float32)

    def call():
        for _ in range(4):
            a @ a
        sync()

    return call


# A decode-like loop in a process of its own: 28 layers of products at 256 rows, then a wait for the
# device, over and over, until killed (stdin closed).
OTHER_PROCESS = """
import sys, threading, torch
dev = "cpu" if sys.argv[1] == "cpu" else "cuda"
x = torch.randn(256, 896, device=dev)
w = torch.randn(896, 896, device=dev)
threading.Thread(target=lambda: (sys.stdin.read(), __import__("os")._exit(0)), daemon=True).start()
print("ready", flush=True)
while True:
    for _ in range(28 * 4):
        x = torch.tanh(x @ w)
    if dev == "cuda":
        torch.cuda.synchronize()
"""


@contextlib.contextmanager
def other_process():
    """A process of its own running OTHER_PROCESS on the device while the block runs."""
    child = subprocess.Popen(
        [sys.executable, "-c", OTHER_PROCESS, DEVICE.type],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # its loop is running
        yield
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def hift_calls(hift, priority: int, traced: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    mel = (torch.randn(ROWS, 80, FRAMES, generator=g) * 2 - 5).to(DEVICE)
    cache = (torch.randn(ROWS, 1, CACHED_SOURCE, generator=g) * 0.1).to(DEVICE)
    gens = [torch.Generator(DEVICE).manual_seed(i) for i in range(ROWS)]
    launch, wait, timeline = [], [], None
    with torch.inference_mode(), stream("hift", priority):
        for i in range(CALLS):
            if traced and i == CALLS - 1:
                timeline = Timeline(start_s=0.0, window_s=30.0)
                timeline.start()
                time.sleep(0.2)  # the profiler is on before the call
            started = time.perf_counter()
            hift(mel, cache, generators=gens)
            launched = time.perf_counter()
            sync()
            done = time.perf_counter()
            launch.append(round(1000 * (launched - started), 2))
            wait.append(round(1000 * (done - launched), 2))
            time.sleep(0.05)
    row = {"launch_ms": launch, "wait_ms": wait}
    if timeline is not None:
        timeline.finish()
        row["timeline"] = timeline.summary()
    return row


def beside(work, hift, priority: int) -> dict:
    """HiFT's calls (hift_calls, the last traced) while a flow-stream thread runs ``work`` in a loop."""
    neighbour = Neighbour("flow", work)
    neighbour.start()
    neighbour.busy.wait()
    try:
        row = hift_calls(hift, priority, traced=True)
    finally:
        neighbour.stop()
    return {"neighbour_calls": neighbour.calls} | row


@torch.inference_mode()
def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "hift-beside.json"
    if os.environ.get("HIFT_BESIDE_SWITCH_MS"):  # the interpreter's switch interval (default 5 ms)
        sys.setswitchinterval(float(os.environ["HIFT_BESIDE_SWITCH_MS"]) / 1000)
    torch.manual_seed(0)
    hift = HiFTGenerator().to(DEVICE).eval()
    hift.fuse_weight_norm()
    flow = CausalMaskedDiffWithXvec().to(DEVICE).eval()
    if not SMOKE:
        cast_matmul_weights(flow, torch.float16)
    rows = []

    def emit(row: dict) -> None:  # rewritten each row: a run cut short keeps its rows
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(out, "w") as f:
            device = torch.cuda.get_device_name() if not SMOKE else "cpu"
            env = {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "HIFT_BESIDE_SWITCH_MS")}
            json.dump({"device": device, "torch": torch.__version__, "env": env, "rows": rows}, f, indent=1)

    flow_call = flow_work(flow)
    started = time.perf_counter()
    flow_call()
    emit({"setting": "flow call alone", "first_ms": round(1000 * (time.perf_counter() - started), 1)})
    started = time.perf_counter()
    flow_call()
    emit({"setting": "flow call alone", "ms": round(1000 * (time.perf_counter() - started), 1)})
    emit({"setting": "alone"} | hift_calls(hift, -1, traced=False))

    def python_loop():
        sum(i * i for i in range(20_000))  # pure Python: holds the interpreter lock, no device work

    settings = (
        ("beside a thread running Python", python_loop, -1),
        ("beside the flow", flow_call, -1),
        ("beside the flow, the same priority", flow_call, 0),
        ("beside small kernels", small_kernels(), -1),
        ("beside large products", large_products(), -1),
    )
    only = os.environ.get("HIFT_BESIDE_ONLY")
    for name, work, priority in settings:
        if only and only not in name:
            continue
        emit({"setting": name} | beside(work, hift, priority))
    if only and "process" not in only:
        return
    with other_process():
        emit({"setting": "beside another process"} | hift_calls(hift, -1, traced=True))
        emit({"setting": "beside another process and the flow"} | beside(flow_call, hift, -1))


if __name__ == "__main__":
    main()
