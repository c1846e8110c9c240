"""What the GPU ran during part of a level, kernel by kernel: a window of torch.profiler's CUDA trace
of this process, summed up per CUDA stream and per launching thread.

A level's stage times say how long each stage took, and the resource sampler how busy the GPU was
(resources.py); neither says which work ran when. Under load the flow thread, the HiFT thread and the
LM's decode steps share one GPU (vLLM's engine core runs in another process unless
``lm_in_process``, and another process's kernels are not in this trace). The window tells:

- how much of it the GPU ran this process's kernels (``busy_share``: the union of every kernel's and
  copy's interval, over ``window_s``, from the first one's start to the last one's end) and how
  much of it two streams ran at once (``overlap_share``);
- per CUDA stream: its kernels' seconds, their categories, and which threads launched them (the
  ``token2wav`` flow thread, ``token2wav-hift``, a vLLM thread...), found through each kernel's
  correlation with the runtime call that launched it (a replayed CUDA graph's kernels carry its
  launch's);
- the gaps in which this process ran nothing (the LM's share, or idle), by length;
- per launching thread, its CUDA runtime calls (``host_calls``): how long they took in all and at
  most, by API. A launch waits when the device's launch queue is full, and a synchronising call for
  the device's work, so a thread whose launches take long was held by the GPU, not by its Python;
- which threads held the interpreter lock, and in which functions (``gil``: gil.py), so a thread
  held neither by the device nor by its CUDA calls shows whom it waited for; and where every thread
  was, running or waiting (``stacks``), down to its innermost line of this project's code.

Recording starts ``start_s`` into the level and lasts ``window_s``; the trace is read and summed up
after the level, so only the recording's own cost (CUPTI's activity records, the device sync at the
window's end on the profiler's thread) falls into it.
"""

import json
import logging
import re
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

from cosyapp.bench.gil import GilSampler
from cosyapp.engine.token2wav.turns import TURNS

log = logging.getLogger(__name__)

# Kernel categories by name, first match wins (this trace's and the profiling scripts': one table):
# attention before convolutions (cuDNN's SDPA kernels are named "..._fprop_..."), convolutions before
# GEMMs (implicit-GEMM convolutions name both), casts before the other copies.
CATEGORIES = (
    ("attention", r"fmha|flash|attention|sdpa"),
    ("convolution", r"conv|fprop|dgrad|wgrad|im2col|implicit_gemm|winograd|cudnn"),
    ("fft", r"fft"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|sm\d+_"),
    ("layer_norm", r"layer_norm|LayerNorm"),
    ("cast", r"_to_copy|bfloat16_copy|float16_copy|to_copy"),
    ("copy_index", r"copy|Cat|cat_|index|gather|scatter|pad|fill|arange"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|softmax|triton"),
)
# Trace categories of device work: kernels and the copies and fills between or on devices.
DEVICE_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
# Gaps in the device's work (this process's), bucketed by length in milliseconds.
GAP_EDGES_MS = (1, 5, 20, 100)


def category(name: str) -> str:
    """A kernel's category (CATEGORIES), "other" where none matches."""
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


class Timeline:
    """One window of a level: ``start`` as the level begins, ``finish`` once it has ended (it ends the
    window if the level was shorter), then ``summary``. The profiler runs on a thread of its own, so
    neither its start nor its stop (which waits for the device) holds the event loop; the trace is
    read only in ``summary``, after the level. In the same window py-spy samples which thread holds
    the interpreter lock (gil.py), and where every thread is, with or without CUDA; without, there is
    no trace and it says so."""

    def __init__(self, start_s: float = 3.0, window_s: float = 3.0):
        self.start_s, self.window_s = start_s, window_s
        self._prof = None
        self._error: str | None = None
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cuda = False
        self.gil = GilSampler()
        self.stacks = GilSampler(held_only=False)

    def start(self) -> None:
        import torch

        self._cuda = torch.cuda.is_available()
        if not self._cuda:
            self._error = "no CUDA device: nothing to trace"
        self._thread = threading.Thread(target=self._record, name="bench-timeline", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """End the window now if it has not ended (blocking: call it off the event loop)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _record(self) -> None:
        if self._stop.wait(self.start_s):
            return  # the level ended first
        self.gil.start()
        self.stacks.start()
        prof = None
        try:
            prof = self._start_trace() if self._cuda else None
            self._stop.wait(self.window_s)
        finally:
            # The lock's window ends with the trace's, before the profiler's stop: the stop reads
            # CUPTI's records holding the lock for seconds (an H200 run at 64 streams: 46 % of a
            # 9.1 s window was the profiler's own exit), which is the recording's cost, not the level's.
            self.gil.stop()
            self.stacks.stop()
            if prof is not None:
                self._stop_trace(prof)
            self.gil.finish()
            self.stacks.finish()

    def _start_trace(self):
        from torch.profiler import ProfilerActivity, profile

        try:
            prof = profile(activities=[ProfilerActivity.CUDA])
            # Both ends in a capture's turn (turns.py): the stop synchronises the device, which a
            # graph capture in progress on another thread would not survive.
            with TURNS.capture():
                prof.start()
            return prof
        except Exception as error:  # the level goes on without its timeline
            log.exception("the level's GPU trace failed to start")
            self._error = f"{type(error).__name__}: {error}"
            return None

    def _stop_trace(self, prof) -> None:
        try:
            with TURNS.capture():
                prof.stop()  # waits for the device: kernels launched in the window are in the trace
            self._names = thread_names()
            self._prof = prof
        except Exception as error:
            log.exception("the level's GPU trace failed")
            self._error = f"{type(error).__name__}: {error}"

    def summary(self) -> dict:
        """The window summed up (``summarise``), or why there is none, with the interpreter lock's
        holders in it (``gil``, gil.py) and where every thread was (``stacks``)."""
        return self._trace_summary() | {"gil": self.gil.summary(), "stacks": self.stacks.summary()}

    def _trace_summary(self) -> dict:
        if self._prof is None:
            return {"error": self._error or "the level ended before its window began"}
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as file:
            trace = Path(file.name)
        try:
            self._prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text()).get("traceEvents", [])
            return summarise(events, self._names)
        except Exception as error:  # a trace this code does not read: the level keeps its other numbers
            log.exception("the level's GPU timeline could not be read")
            return {"error": f"{type(error).__name__}: {error}"}
        finally:
            trace.unlink(missing_ok=True)
            self._prof = None


def thread_names() -> dict[int, str]:
    """This process's Python threads by every id a trace may give a launching thread: the OS thread id,
    the pthread handle, and the handle's low 32 bits read unsigned and signed (an H100 trace gave
    those, so its threads went unnamed)."""
    names = {}
    for thread in threading.enumerate():
        if thread.native_id is not None:
            names[thread.native_id] = thread.name
        if thread.ident is not None:
            low = thread.ident & 0xFFFFFFFF
            for key in (thread.ident, low, low - (1 << 32) if low >= 1 << 31 else low):
                names[key] = thread.name
    return names


def summarise(events: list[dict], names: dict[int, str]) -> dict:
    """A chrome trace's device work (module docstring). ``names``: thread ids to names (thread_names);
    a launching thread not among them is named by its id. Times in the trace are microseconds."""
    launcher = {}  # correlation id -> the launching thread's name
    host: dict[str, dict] = defaultdict(
        lambda: {
            "calls": 0,
            "s": 0.0,
            "longest_ms": 0.0,
            "api_s": defaultdict(float),
            "api_ms": defaultdict(float),
        }
    )
    for event in events:
        if event.get("cat") == "cuda_runtime":
            tid = event.get("tid")
            thread = names.get(tid, f"thread {tid}")
            if "correlation" in event.get("args", {}):
                launcher[event["args"]["correlation"]] = thread
            seconds = event.get("dur", 0) / 1e6
            calls = host[thread]
            calls["calls"] += 1
            calls["s"] += seconds
            calls["longest_ms"] = max(calls["longest_ms"], 1000 * seconds)
            calls["api_s"][event.get("name", "?")] += seconds
            # the longest call of each API: one long cudaMalloc or sync tells apart from many launches
            calls["api_ms"][event.get("name", "?")] = max(
                calls["api_ms"][event.get("name", "?")], 1000 * seconds
            )
    work = [
        e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X" and e.get("dur") is not None
    ]
    if not work:
        return {"kernels": 0, "window_s": None}
    begin = min(e["ts"] for e in work)
    end = max(e["ts"] + e["dur"] for e in work)
    window = max(end - begin, 1e-9)
    streams: dict[str, dict] = defaultdict(
        lambda: {"busy_s": 0.0, "kernels": 0, "threads": defaultdict(int), "categories": defaultdict(float)}
    )
    categories: dict[str, float] = defaultdict(float)
    intervals = []
    for event in work:
        args = event.get("args", {})
        stream = streams[str(args.get("stream", event.get("tid")))]
        seconds = event["dur"] / 1e6
        kind = DEVICE_CATS[event["cat"]]
        label = category(event.get("name", "")) if kind == "kernel" else kind
        stream["busy_s"] += seconds
        stream["kernels"] += 1
        stream["threads"][launcher.get(args.get("correlation"), "?")] += 1
        stream["categories"][label] += seconds
        categories[label] += seconds
        intervals.append((event["ts"], event["ts"] + event["dur"]))
    busy, overlap, gaps = _sweep(intervals)
    edges = (*GAP_EDGES_MS, None)
    gap_table = {_gap_label(i): {"count": 0, "s": 0.0} for i in range(len(edges))}
    for gap in gaps:
        i = next(i for i, edge in enumerate(edges) if edge is None or gap / 1000 < edge)
        gap_table[_gap_label(i)]["count"] += 1
        gap_table[_gap_label(i)]["s"] += gap / 1e6
    return {
        "window_s": round(window / 1e6, 3),
        "kernels": len(work),
        "busy_share": round(busy / window, 4),
        "overlap_share": round(overlap / window, 4),
        "categories_s": _largest_first(categories),
        "gaps": {k: {"count": v["count"], "s": round(v["s"], 4)} for k, v in gap_table.items()},
        "host_calls": {
            thread: {
                "calls": c["calls"],
                "s": round(c["s"], 6),
                "longest_ms": round(c["longest_ms"], 3),
                "api_s": dict(list(_largest_first(c["api_s"], 6).items())[:5]),
                "api_longest_ms": dict(list(_largest_first(c["api_ms"], 3).items())[:5]),
            }
            for thread, c in sorted(host.items(), key=lambda kv: -kv[1]["s"])
        },
        "streams": {
            name: {
                "busy_s": round(s["busy_s"], 4),
                "busy_share": round(s["busy_s"] * 1e6 / window, 4),
                "kernels": s["kernels"],
                "threads": dict(sorted(s["threads"].items(), key=lambda kv: -kv[1])),
                "categories_s": {
                    k: round(v, 4) for k, v in sorted(s["categories"].items(), key=lambda kv: -kv[1])
                },
            }
            for name, s in sorted(streams.items(), key=lambda kv: -kv[1]["busy_s"])
        },
    }


def _largest_first(seconds: dict[str, float], digits: int = 4) -> dict[str, float]:
    return {k: round(v, digits) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


def _gap_label(i: int) -> str:
    low = 0 if i == 0 else GAP_EDGES_MS[i - 1]
    return f"{low}+ ms" if i == len(GAP_EDGES_MS) else f"{low}-{GAP_EDGES_MS[i]} ms"


def _sweep(intervals: list[tuple[float, float]]) -> tuple[float, float, list[float]]:
    """(time covered by any interval, time covered by two or more, the gaps between covered spans)."""
    points = sorted([(start, 1) for start, _ in intervals] + [(stop, -1) for _, stop in intervals])
    busy = overlap = 0.0
    gaps = []
    depth, last = 0, None
    for at, step in points:
        if last is not None:
            if depth >= 1:
                busy += at - last
            if depth >= 2:
                overlap += at - last
            if depth == 0 and at > last:
                gaps.append(at - last)
        depth += step
        last = at
    return busy, overlap, gaps
