"""CUDA graph captures and the compile thread's compiled calls take turns on the GPU.

A compiled graph's first run tunes its Triton kernels: inductor times each candidate launch and
synchronises the device between them. A device-wide synchronise while any stream is being
captured is an error for both sides: the capture is invalidated and the synchronise fails (seen on
an H100: the compile thread's first forward run broke the start's capture of a flow bucket, and the
process aborted; docs/benchmarks/README.md, "Compiling while serving, on a GPU"). Captures are
thread-local otherwise, so other threads' launches do not disturb them.

So the compile thread (compiling.py) runs compiled graphs only while no capture is in progress, and
a capture starts only while the compile thread runs none. Compiling itself, the long part, runs
beside captures: the turn is taken around each run of a compiled graph, inside the backend that
``compile`` gives torch.compile, and only on the compile thread. A serving thread's compiled calls,
which may be part of its own capture, take no turn (their kernels were tuned on the compile thread,
whose call of each kind comes first). Captures wait for at most one compiled run (about a second);
the compile thread waits for the capture in progress, and captures asked for after it wait for it.

Captures also take turns among themselves: one at a time in the process. ``torch.cuda.graph``
captures on one side stream that every capture shares, and synchronises the device as it begins; a
second thread's capture begun meanwhile fails (seen on an H100 while the compile thread recaptured
the flow's buckets and the incremental flow's capture thread captured a new bucket: "Cannot register
the state during capturing stage"), and the graph it leaves behind aborts the process when freed.

One more thing the two threads share: inductor symbolically traces (torch.fx) parts of what it
compiles, and torch.fx says so through a process-wide flag. A compiled function called on a serving
thread meanwhile would raise ("FX to symbolically trace a dynamo-optimized function"; seen on an
H100 while the start captured a bucket). ``compile`` turns that error off for the process, so such
a call runs its function eagerly instead: the same arithmetic. Inside a serving thread's capture the
graph then replays those eager kernels until it is captured again, which the compile's end brings
(compiling.py: a graph captured before a compile ends is stale).
"""

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from cosyapp.engine.cuda_streams import role_stream

T = TypeVar("T")

COMPILE_THREAD = "flow-compile"


class Turns:
    """Captures (one at a time, on any threads) against the compile thread's compiled runs."""

    def __init__(self):
        self._cond = threading.Condition()
        self._captures = 0
        self._running = 0  # the compile thread's runs (nested runs count each)
        self.waiting_runs = 0  # compiled runs waiting for captures to end (tests read it)
        self._mine = threading.local()  # this thread's captures in progress

    @contextlib.contextmanager
    def capture(self):
        with self._cond:
            # A run waiting goes first: a start's back-to-back captures would otherwise hold it off.
            self._cond.wait_for(lambda: self._captures == 0 and self._running == 0 and self.waiting_runs == 0)
            self._captures += 1
        self._mine.captures = self.captures_here() + 1
        try:
            yield
        finally:
            self._mine.captures -= 1
            with self._cond:
                self._captures -= 1
                self._cond.notify_all()

    def captures_here(self) -> int:
        return getattr(self._mine, "captures", 0)

    @contextlib.contextmanager
    def run(self):
        """A compiled run's turn. Inside a capture of this same thread (the compile thread recaptures
        stale buckets) the run is recorded, not run, and needs none: waiting would wait for itself."""
        if self.captures_here():
            yield
            return
        with self._cond:
            if self._running == 0:
                self.waiting_runs += 1
                self._cond.wait_for(lambda: self._captures == 0)
                self.waiting_runs -= 1
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()


TURNS = Turns()


def capture_graph(call: Callable[[], T], device: torch.device, pool, warm_ups: int = 2):
    """``call`` captured into a CUDA graph drawing on memory ``pool``: ``(graph, what the captured
    call returned)`` (its static outputs). In its turn (module docstring), on the captures' own
    stream (cosyapp/engine/cuda_streams.py), ``call`` runs ``warm_ups`` times first, so lazy kernels,
    workspaces and cuDNN/cuFFT plans settle outside the capture; the capture is thread-local, so
    other threads' CUDA work on their own streams cannot break it."""
    caller = torch.cuda.current_stream(device)
    stream = role_stream("capture", device)
    with TURNS.capture():
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for _ in range(warm_ups):
                call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            output = call()
        caller.wait_stream(stream)
    return graph, output


def empty_cache_in_turn() -> None:
    """``torch.cuda.empty_cache()`` in a turn of a capture's: the frees synchronise the device, which
    another thread's capture in progress would not survive."""
    if torch.cuda.is_initialized():
        with TURNS.capture():
            torch.cuda.empty_cache()


def on_compile_thread() -> bool:
    return threading.current_thread().name == COMPILE_THREAD


def _taking_turns(compiled):
    """``compiled`` (a graph inductor made), each of its runs on the compile thread in its turn."""

    def run(*args, **kwargs):
        if not on_compile_thread():
            return compiled(*args, **kwargs)
        with TURNS.run():
            return compiled(*args, **kwargs)

    return run


class _Inductor(torch._TorchCompileInductorWrapper):
    """torch.compile's inductor backend, its graphs run in turns (``_taking_turns``)."""

    def __call__(self, model_, inputs_, **kwargs):
        return _taking_turns(super().__call__(model_, inputs_, **kwargs))


def compile(fn, mode: str | None = None):
    """``torch.compile(fn, dynamic=True, mode=mode)`` whose compiled graphs take their turns, and
    which runs eagerly when called while another thread's fx trace is in progress (module docstring)."""
    torch._dynamo.config.error_on_nested_fx_trace = False
    return torch.compile(fn, dynamic=True, backend=_Inductor(mode, None, True))
