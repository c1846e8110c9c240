"""The incremental flow's calls replayed from CUDA graphs, one per shape bucket (``IncrementalGraphs``),
captured on a thread of their own (cached.py) while the calls of a bucket not captured yet run
eagerly; see incremental.py for the call itself. A bucket's graph holds the call's ten Euler steps,
or (``step_graphs``) one step, replayed ten times."""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from cosyapp.engine.token2wav.capturing import MissedCalls
from cosyapp.engine.token2wav.compiling import noting_eager_kinds
from cosyapp.engine.token2wav.graph_table import Captured, GraphTable
from cosyapp.engine.token2wav.incremental import (
    CallInputs,
    EulerSteps,
    IncrementalEstimator,
    euler_times,
    run_cfm,
)
from cosyapp.engine.token2wav.turns import capture_graph
from cosyapp.models.flow_estimator import autocast_dtype

if TYPE_CHECKING:
    from cosyapp.engine.token2wav.pages import KVPool

log = logging.getLogger(__name__)


@dataclass
class _Graph(Captured):
    graph: torch.cuda.CUDAGraph
    inputs: CallInputs
    x: Tensor  # the call's x; of one step's graph, its state (inputs.x, moved in place)
    tails: Tensor
    # One step's graph: the step it runs, written before each replay (the Euler times stay alive
    # beside it, as the graph reads them).
    step: Tensor | None = None
    times: tuple[Tensor, Tensor] | None = None

    def run(self, inputs: CallInputs) -> tuple[Tensor, Tensor]:
        self.inputs.copy_(inputs)
        if self.step is None:
            self.replay()
        else:
            self.tails.copy_(self.inputs.tails)
            for k in range(self.tails.size(0)):
                self.step.fill_(k)
                self.replay()
        return self.x.clone(), self.tails.clone()


class IncrementalGraphs:
    """``run_cfm`` replayed from one CUDA graph per (rows, new frames, past pages) bucket.

    Eager, a call is launch-bound at every batch size (docs/benchmarks/README.md); replayed, the
    kernels run back to back. The Pipeline's warm-up meets the common buckets
    (Pipeline.warm_up_token2wav). A capture runs the call eagerly three times (one to two seconds),
    so with ``defer`` a bucket's first call runs eagerly once and keeps a copy of its inputs, and a
    thread of its own captures it (``capture_missed``, cached.py) while the flow thread serves on;
    calls that come before the capture has ended run eagerly too. Without ``defer`` the first call
    captures and then replays, holding the flow thread meanwhile.

    ``step_graphs``: a bucket's graph is one Euler step, which reads the step from a tensor and is
    replayed once per step: its capture runs a tenth of the kernels three times and instantiates a
    tenth of the nodes, on the GPU that serving needs (captures beside serving took 6-15 s of a
    256-stream level on an H100), for ten launches a call instead of one and the call's input
    concatenations made at each step. Cheap enough to capture every bucket of a row size once a call
    of that size shows the calls' dtypes (``plan``: the warm-up's streams meet every row bucket, and
    it waits for these captures too), so that no bucket is captured while serving.
    """

    def __init__(
        self,
        step_fn: IncrementalEstimator,
        pool: "KVPool",
        cfg_rate: float,
        defer: bool = True,
        step_graphs: bool = False,
    ):
        self.step_fn, self.pool, self.cfg_rate = step_fn, pool, cfg_rate
        self.defer, self.step_graphs = defer, step_graphs
        self._graphs: GraphTable[_Graph] = GraphTable()
        self._missed: MissedCalls[CallInputs] = MissedCalls()  # buckets met but not captured
        # Buckets no call has met yet, to capture from blank inputs (``plan``), and their builders.
        self._blanks: dict[tuple, Callable[[], CallInputs]] = {}
        self._blanks_lock = threading.Lock()
        self._pool = None
        self.eager_calls = 0  # calls run eagerly because their bucket had no graph yet
        self.captures = 0  # deferred captures done (or failed)
        self.capture_seconds = 0.0

    @property
    def missed(self) -> int:
        """Buckets waiting for ``capture_missed``."""
        with self._blanks_lock:
            return len(self._missed) + len(self._blanks)

    @staticmethod
    def key(inputs: CallInputs, attn_shape: tuple[int, ...] | None = None) -> tuple:
        """A call's bucket (its attention mask's shape, or ``attn_shape``) with its dtypes and the
        autocast it runs under."""
        shape = tuple(inputs.attn_mask.shape) if attn_shape is None else attn_shape
        dtypes = (inputs.attn_mask.dtype, inputs.x.dtype, inputs.tails.dtype)
        return (*shape, *dtypes, autocast_dtype(inputs.x.device))

    def plan(self, blanks: dict[tuple, Callable[[], CallInputs]]) -> None:
        """Capture these buckets (key: a builder of blank inputs at its shape) once no missed call
        waits, those captured already left out (step graphs: see the class docstring)."""
        with self._blanks_lock:
            for key, build in blanks.items():
                if key not in self._graphs:
                    self._blanks.setdefault(key, build)

    def run(self, inputs: CallInputs) -> tuple[Tensor, Tensor]:
        if not inputs.x.is_cuda:  # the same steps eagerly, indexed as their graphs would
            return run_cfm(self.step_fn, self.pool.kv, inputs, self.cfg_rate, self.step_graphs)
        key = self.key(inputs)
        graph = self._graphs.lookup(key)
        if graph is None and (self.defer or key in self._missed.failed):
            self._miss(key, inputs)
            self.eager_calls += 1
            return run_cfm(self.step_fn, self.pool.kv, inputs, self.cfg_rate)
        if graph is None:  # captured, then found by a lookup like every graph replayed (GraphTable)
            self._capture(key, inputs)
            graph = self._graphs.lookup(key)
        if graph.stale:  # captured before a compile (compiling.py): capture it again
            self._miss(key, inputs)
        return graph.run(inputs)

    def _miss(self, key: tuple, inputs: CallInputs) -> None:
        """Keep a copy of ``inputs`` for the capture thread to capture ``key`` with, unless it has one."""

        def copy() -> CallInputs:
            kept = inputs.empty_like()
            kept.copy_(inputs)
            return kept

        if self._missed.keep(key, copy, inputs.x.device):
            log.info("incremental flow bucket %s to capture: its calls run eagerly meanwhile", key[:4])

    def free(self) -> None:
        """Drop every graph and kept input (their flow is stopped for good; the pool frees its own)."""
        self._graphs.clear()
        self._missed.clear()
        with self._blanks_lock:
            self._blanks.clear()

    def capture_missed(self) -> bool:
        """Capture one bucket a call met since (under the autocast it ran with), or else one
        ``plan`` holds; False when none was waiting. One thread calls it, on a CUDA stream of its
        own, beside the thread that runs the calls. The bucket counts as missed until its capture
        has ended."""
        with self._missed.oldest() as missed:
            if missed is not None:
                self._capture_timed(*missed)
                return True
        with self._blanks_lock:
            key = next(iter(self._blanks), None)
            build = self._blanks.get(key)
        if key is None:
            return False
        try:
            # a missed call of the bucket may have come first, or its capture failed
            if key not in self._graphs and key not in self._missed.failed:
                self._capture_timed(key, build())
        finally:
            with self._blanks_lock:
                self._blanks.pop(key, None)
        return True

    def _capture_timed(self, key: tuple, like: CallInputs) -> None:
        dtype = key[-1]
        started = time.perf_counter()
        try:
            with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
                self._capture(key, like)
        except Exception:  # out of memory, or any other failure: the worker serves on
            # Its calls stay eager, or replay the graph captured before a compile (not again).
            log.exception("capturing the incremental flow's graph for %s failed; no more tries", key[:4])
            self._missed.fail(key)
        finally:
            self.captures += 1
            self.capture_seconds += time.perf_counter() - started
        if key in self._graphs:
            log.info("incremental flow bucket %s captured in %.2f s", key[:4], time.perf_counter() - started)

    def _capture(self, key: tuple, like: CallInputs) -> None:
        static = like.empty_like()
        static.copy_(like)
        dev = like.x.device
        # Warm-up and capture write to the trash page only, so the pool's real pages stay as they are.
        static.write_rows.zero_()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        kv = self.pool.kv
        step, times = None, None
        with noting_eager_kinds() as eager:  # a compile ending during the capture makes it stale
            if self.step_graphs:
                step = torch.zeros(1, dtype=torch.long, device=dev)
                times = euler_times(static.tails.size(0), dev, static.mu.dtype)
                x, tails = static.x, static.tails.clone()

                def one_step() -> None:
                    euler = EulerSteps(self.step_fn, kv, static, self.cfg_rate, tails, times)
                    x.copy_(euler.step(step, x))

                graph, _ = capture_graph(one_step, dev, self._pool)
            else:
                call = lambda: run_cfm(self.step_fn, kv, static, self.cfg_rate)  # noqa: E731
                graph, (x, tails) = capture_graph(call, dev, self._pool)
        captured = _Graph(graph, static, x, tails, step=step, times=times, eager=frozenset(eager))
        # The static inputs are another thread's to write once the graph is published.
        torch.cuda.current_stream(dev).synchronize()
        # After a compile: in place of the old, which the flow thread may be replaying (compiling.py).
        self._graphs.put(key, captured)
