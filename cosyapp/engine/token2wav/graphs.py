"""Replay the flow estimator from CUDA graphs, one per (rows, frames, attention mode) bucket.

At the batch sizes a serving engine sees, one eager estimator step is launch-bound (on an H200 ~25 ms
eager against ~6 ms replayed, docs/benchmarks/2026-12-02-h200-flow-steps.json), and the CFM takes ten
steps per flow call. Inputs are padded up to a bucket: extra frames get mask 0 (the estimator is causal
and masks padded keys, so valid frames are unchanged) and extra rows are independent dummies.

Every bucket is captured once at start-up (``capture_all``), so requests never pay for a capture.
Calls larger than the biggest bucket (MAX_CELLS) run eagerly: there the GPU, not the launches, is the
limit, and padding would only add work.
"""

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from cosyapp.engine.token2wav.compiling import COMPILER, noting_eager_kinds
from cosyapp.engine.token2wav.fused import compile_unmasked, in_background
from cosyapp.engine.token2wav.graph_table import Captured, GraphTable
from cosyapp.engine.token2wav.turns import capture_graph
from cosyapp.models.flow_estimator import autocast_dtype

if TYPE_CHECKING:
    from cosyapp.models.cosyvoice2 import CosyVoice2

log = logging.getLogger(__name__)

ROW_BUCKETS = (2, 4, 8, 16, 32, 64)  # estimator rows: CFG doubles the items, so up to 32 items
FRAME_STEP = 128  # frames are padded up to a multiple of this ...
MAX_FRAMES = 2048  # ... up to here (prompt + generated mel frames: ~40 s of speech)
# Rows x frames of the largest graph. Measured on an H200 (docs/benchmarks/*-token2wav-speed.json),
# a flow call of 16 items x 206 frames takes 168 ms graphed against 344 ms eager, 32 x 206 266 against
# 371, but 64 x 206 488 against 426 and 16 x 670 the same both ways: past ~16k cells the GPU is the
# limit and the padding to a bucket only adds work.
MAX_CELLS = 16384


@dataclass
class _Captured(Captured):
    graph: torch.cuda.CUDAGraph | None  # None: pad and run eagerly (CPU, or to check the padding)
    inputs: tuple[Tensor, ...]  # x, mask, mu, t, spks, cond at the bucket's shape
    output: Tensor


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= value, or None past the last one."""
    return next((b for b in buckets if b >= value), None)


class GraphedEstimator(nn.Module):
    """Drop-in for ``CausalConditionalDecoder.forward`` that pads to buckets and replays CUDA graphs.

    A call is graphed when its rows and frames fit in the buckets and the bucket holds at most
    ``max_cells`` rows x frames; others run eagerly as they are.
    ``use_graphs`` False pads and runs eagerly (CPU, or to check the padding). A graph replays on the
    thread that calls it; captures use thread-local capture mode, so other threads' CUDA work (the
    event loop's prompt embeddings) cannot break them.
    """

    def __init__(
        self,
        estimator: nn.Module,
        row_buckets: tuple[int, ...] = ROW_BUCKETS,
        frame_buckets: tuple[int, ...] = tuple(range(FRAME_STEP, MAX_FRAMES + 1, FRAME_STEP)),
        max_cells: int = MAX_CELLS,
        use_graphs: bool = True,
    ):
        super().__init__()
        self.estimator = estimator
        self.row_buckets = row_buckets
        self.frame_buckets = frame_buckets
        self.max_cells = max_cells
        self.use_graphs = use_graphs
        self._graphs: GraphTable[_Captured] = GraphTable()
        self._pool = None
        self._capturing = threading.Lock()  # one capture at a time: the flow's start, the compile thread
        self.recaptured = 0  # buckets captured again after compiles (recapture_stale)
        if in_background(estimator):  # --compile-flow: replay the compiled kernels once compiled
            COMPILER.on_epoch(self.recapture_stale)

    @property
    def out_channels(self) -> int:
        return self.estimator.out_channels

    @property
    def captured(self) -> int:
        """Number of buckets captured so far."""
        return len(self._graphs)

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
        all_valid: bool = False,
    ) -> Tensor:
        rows, _, frames = x.shape
        shape = (bucket(rows, self.row_buckets), bucket(frames, self.frame_buckets))
        if None in shape or shape[0] * shape[1] > self.max_cells:
            return self.estimator(x, mask, mu, t, spks, cond, streaming, all_valid)
        # A bucket pads frames and rows, so its graph always runs with the attention mask.
        key = (*shape, streaming, x.dtype, autocast_dtype(x.device), x.device)
        captured = self._graphs.lookup(key)
        if captured is None:  # captured, then found by a lookup like every graph replayed (GraphTable)
            self._capture(key, (x, mask, mu, t, spks, cond), streaming)
            captured = self._graphs.lookup(key)
        _fill(captured.inputs, (x, mask, mu, t, spks, cond))
        if captured.graph is None:
            return self.estimator(*captured.inputs, streaming)[:rows, :, :frames]
        captured.replay()
        return captured.output[:rows, :, :frames].clone()

    def capture_all(self, device: torch.device, dtype: torch.dtype) -> int:
        """Capture every bucket (both attention modes) for inputs of ``dtype`` under the current
        autocast state; returns the number of buckets now captured."""
        for rows in self.row_buckets:
            for frames in (f for f in self.frame_buckets if rows * f <= self.max_cells):
                for streaming in (False, True):
                    key = (rows, frames, streaming, dtype, autocast_dtype(device), device)
                    if key not in self._graphs:
                        like = _blank_inputs(rows, frames, self.out_channels, device, dtype)
                        self._capture(key, like, streaming)
        return self.captured

    def recapture_stale(self, epoch: int) -> int:
        """Capture again every stale bucket, whose graph replays eager kernels of calls the compile
        thread has compiled since (compiling.py); the old graph serves until the new one replaces it.
        Runs on the compile thread (a hook of the flow's ``epoch``): only the flow thread replays, and
        a capture runs nothing, so the shared memory pool is never in use by two graphs at once.
        Returns the count."""
        stale = self._graphs.stale()
        for key, captured in stale:
            autocast = key[4]
            device = captured.inputs[0].device
            with (
                torch.inference_mode(),
                torch.autocast(device.type, dtype=autocast, enabled=autocast is not None),
            ):
                self._capture(key, captured.inputs, key[2])
        self.recaptured += len(stale)
        if stale:
            log.info("captured %d flow estimator graphs again with the compiled flow", len(stale))
        return len(stale)

    def _capture(self, key: tuple, like: tuple[Tensor, ...], streaming: bool) -> None:
        with self._capturing:
            self._capture_now(key, like, streaming)

    def _capture_now(self, key: tuple, like: tuple[Tensor, ...], streaming: bool) -> None:
        rows, frames = key[0], key[1]
        x, mask, mu, t, spks, cond = like
        inputs = _blank_inputs(rows, frames, x.size(1), x.device, x.dtype, mu.size(1), cond.size(1))
        with noting_eager_kinds() as eager:  # a compile ending during the capture makes it stale
            if not (self.use_graphs and x.is_cuda):
                if in_background(self.estimator):  # run as a capture would, for the kinds it meets
                    self.estimator(*inputs, streaming)
                graph, output = None, inputs[0]
            else:
                self._pool = self._pool or torch.cuda.graph_pool_handle()
                run = functools.partial(self.estimator, *inputs, streaming)
                graph, output = capture_graph(run, x.device, self._pool)
        # After a compile: in place of the old (compiling.py).
        self._graphs.put(key, _Captured(graph, inputs, output, eager=frozenset(eager)))


def _blank_inputs(
    rows: int,
    frames: int,
    channels: int,
    device: torch.device,
    dtype: torch.dtype,
    mu_channels: int | None = None,
    cond_channels: int | None = None,
) -> tuple[Tensor, ...]:
    """Zero inputs of a bucket; the mask is all ones so dummy rows are ordinary (finite) items."""

    def zeros(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    return (
        zeros(rows, channels, frames),
        torch.ones((rows, 1, frames), dtype=dtype, device=device),
        zeros(rows, mu_channels or channels, frames),
        zeros(rows),
        zeros(rows, channels),
        zeros(rows, cond_channels or channels, frames),
    )


def _fill(static: tuple[Tensor, ...], given: tuple[Tensor, ...]) -> None:
    """Copy the call's tensors into the bucket's inputs; padded frames get mask 0, dummy rows mask 1."""
    x, mask, mu, t, spks, cond = given
    rows, _, frames = x.shape
    sx, smask, smu, st, sspks, scond = static
    for dst, src in ((sx, x), (smu, mu), (scond, cond)):
        dst[:rows, :, :frames].copy_(src)
        dst[:rows, :, frames:].zero_()
    smask[:rows].zero_()
    smask[:rows, :, :frames].copy_(mask)
    st[:rows].copy_(t)
    sspks[:rows].copy_(spks)


def capture_estimator_graphs(model: "CosyVoice2", autocast_dtype: torch.dtype | None) -> int:
    """Capture every bucket of ``model``'s flow estimator if it is a GraphedEstimator, for the dtype
    the token2wav worker runs it in (``autocast_dtype``, else the flow's own). Returns the count.

    A compiled estimator (``--compile-flow``) then also compiles the attention mode no bucket captures
    (fused.compile_unmasked), so that no request waits for its compile (minutes at full size)."""
    estimator = model.flow.decoder.estimator
    if not isinstance(estimator, GraphedEstimator):
        return 0
    dev = model.device
    dtype = autocast_dtype or model.flow.input_embedding.weight.dtype
    with (
        torch.inference_mode(),
        torch.autocast(dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None),
    ):
        started = time.perf_counter()
        count = estimator.capture_all(dev, dtype)
        blank = _blank_inputs(2, FRAME_STEP, estimator.out_channels, dev, dtype)
        compile_unmasked(estimator.estimator, blank)
    log.info("captured %d flow estimator graphs in %.1f s", count, time.perf_counter() - started)
    return count
