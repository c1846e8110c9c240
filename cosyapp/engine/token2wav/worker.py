"""Token-to-wave service shared by every stream: a flow thread and a HiFT thread batch the work.

    Stream.run(tokens) --chunk schedule--> Job --queue--> flow thread: take the most urgent pending
        jobs (<= max_batch, their padded size bounded: scheduler.py) -> flow: one padded call per
        (streaming, finalize) mode --hand-off--> HiFT thread: per stream, in order: speed change,
        HiFT caches, HiFT batched by equal mel length, cross-fade -> future -> Stream.run yields audio

With ``overlap_hift`` (on by default on a GPU) the two stages run on their own threads and CUDA
streams, so HiFT of one step runs beside the flow of the next; the hand-off holds at most
``HANDOFF_STEPS`` finished flow steps, so the flow never runs far ahead of what listeners hear.
Without it one thread runs both stages in turn, as before. Either way each stream's HiFT calls run in
order on one thread, and its audio is the same.

Each stream's state lives in its Stream (stream.py), so its audio depends only on its own prompt,
tokens and seed, never on which streams share its batches (docs/model.md §8.6, §10).
"""

import asyncio
import contextlib
import functools
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace

import numpy as np
import torch

from cosyapp.engine.cuda_streams import role_stream
from cosyapp.engine.lm.gate import process_gate
from cosyapp.engine.token2wav.cached import CachedFlow
from cosyapp.engine.token2wav.capturing import CaptureThread
from cosyapp.engine.token2wav.chunking import MEL_CACHE_FRAMES, ChunkSchedule
from cosyapp.engine.token2wav.compiling import COMPILER
from cosyapp.engine.token2wav.flow_steps import FlowSteps
from cosyapp.engine.token2wav.graphs import capture_estimator_graphs
from cosyapp.engine.token2wav.hift_graphs import HiFTRunner
from cosyapp.engine.token2wav.jobs import failing
from cosyapp.engine.token2wav.scheduler import JobQueue
from cosyapp.engine.token2wav.stats import Token2WavStats
from cosyapp.engine.token2wav.stream import Job, Stream
from cosyapp.engine.token2wav.vocoding import Vocoding
from cosyapp.engine.token2wav.yielding import Hold, LmYield
from cosyapp.models.cosyvoice2 import TOKEN_MEL_RATIO, CosyVoice2, PromptInputs
from cosyapp.options import DEFAULTS

logger = logging.getLogger(__name__)
# Finished flow steps waiting for the HiFT thread before the flow thread waits too.
HANDOFF_STEPS = 1


class Token2Wav:
    """The shared token-to-wave worker (flow + HiFT) with per-stream chunking and caches.

    max_batch: most jobs taken per worker step. first_hop: tokens of the first streaming hop before
    its alignment pad (25 as upstream; see ChunkSchedule for smaller values). autocast_dtype: run
    the flow under autocast (fp16/bf16 on CUDA); HiFT always runs in float32, as upstream.
    flow_cache_bytes: memory for the incremental streaming flow's pages (cached.py), 0 = recompute
    every chunk's prefix as upstream, None = cached.FLOW_CACHE_SHARE of the GPU memory free at
    start() (off on a CPU); flow_cache_graphs: replay its calls from CUDA graphs, with
    flow_step_graphs one graph of one Euler step per bucket (incremental_graphs.py); chunked_final:
    see CachedFlow. flow_cache_inputs: the pool keeps attention inputs instead of keys and values
    (pages.py). gather_ms: how long an idle worker gathers the jobs of its next step
    (scheduler.py); expect_ms: how long a step waits for the jobs of streams a token or two short of
    their next chunk (scheduler.py). step_frames: the padded rows x frames one step's flow call may
    reach (scheduler.py; None: max_batch x ServeOptions.step_frames_per_row), whole_step_frames while no
    stream streams (None: step_frames), late_step_frames while the most urgent job's stream has been dry
    for a second (None: step_frames); max_batch_per_call: max_batch bounds each flow call's rows
    instead of the step's jobs (scheduler.py). fill_ms: how long a step with no urgent job waits for more
    (scheduler.py; 0: never). overlap_hift: HiFT on
    its own thread (and CUDA stream) beside the next flow step (module docstring). stream_priority:
    of those CUDA streams (0, or -1 before the LM's); hift_first: HiFT's one priority above the flow's.
    hift_graphs: replay HiFT calls from CUDA graphs (hift_graphs.py). flow_overlap: a step's
    incremental call on a CUDA stream of its own beside its recompute calls (flow_steps.py). lm_yield_ms:
    the longest a step that makes a first chunk holds the LM's decode steps (yielding.py; 0: never).
    Jobs submitted before start() wait for it.
    """

    def __init__(
        self,
        model: CosyVoice2,
        max_batch: int = DEFAULTS.max_batch,
        first_hop: int = DEFAULTS.first_hop,
        autocast_dtype: torch.dtype | None = None,
        flow_cache_bytes: int | None = 0,
        flow_cache_graphs: bool = False,
        flow_step_graphs: bool = False,
        chunked_final: bool = DEFAULTS.chunked_final,
        flow_cache_inputs: bool = DEFAULTS.flow_cache_inputs,
        gather_ms: float = DEFAULTS.gather_ms,
        expect_ms: float = DEFAULTS.expect_ms,
        step_frames: int | None = None,
        whole_step_frames: int | None = None,
        late_step_frames: int | None = None,
        max_batch_per_call: bool = DEFAULTS.max_batch_per_call,
        fill_ms: float = DEFAULTS.fill_ms,
        overlap_hift: bool = False,
        stream_priority: int = DEFAULTS.token2wav_priority,
        hift_first: bool = False,
        hift_graphs: bool = False,
        flow_overlap: bool = False,
        lm_yield_ms: float = 0.0,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        ChunkSchedule(0, first_hop)  # validates first_hop
        self.model = model
        self.max_batch = max_batch
        self.first_hop = first_hop
        self.autocast_dtype = autocast_dtype
        self.step_frames = step_frames or max_batch * DEFAULTS.step_frames_per_row
        self.whole_step_frames = whole_step_frames  # None: the queue keeps to step_frames
        self.late_step_frames = late_step_frames  # None: the queue keeps to step_frames
        self.max_batch_per_call = max_batch_per_call
        self.gather_s, self.expect_s, self.fill_s = gather_ms / 1000, expect_ms / 1000, fill_ms / 1000
        self._stats = Token2WavStats()
        rows = max_batch if max_batch_per_call else None
        self.flow = FlowSteps(model, autocast_dtype, self._stats, flow_overlap, stream_priority, rows)
        self._queue = self._new_queue()
        self._submitted = 0  # jobs ever submitted (written on the loop only)
        self.overlap_hift, self.stream_priority, self.hift_first = overlap_hift, stream_priority, hift_first
        self._thread: threading.Thread | None = None
        self._vocoder: threading.Thread | None = None
        self._handoff: queue.Queue[tuple[list[Job], Hold | None] | None] = queue.Queue(HANDOFF_STEPS)
        self.lm_yield = LmYield(process_gate(), lm_yield_ms / 1000) if lm_yield_ms > 0 else None
        self._stopped = False
        # HiFT's shapes captured by the capture thread (capturing.py), as the flow's buckets are
        hift_runner = HiFTRunner(model.hift, hift_graphs, defer=True)
        self.vocoding = Vocoding(hift_runner, self._stats, model.sample_rate)
        self._captures: CaptureThread | None = None
        dtype = autocast_dtype or model.flow.input_embedding.weight.dtype
        flow_cache = (flow_cache_bytes, dtype, flow_cache_graphs, chunked_final, flow_cache_inputs)
        self._cached_flow = functools.partial(
            CachedFlow.sized, model, *flow_cache, step_graphs=flow_step_graphs
        )

    def _new_queue(self) -> JobQueue:
        waits = {"expect_s": self.expect_s, "fill_s": self.fill_s}
        bounds = {
            "whole_step_frames": self.whole_step_frames,
            "late_step_frames": self.late_step_frames,
            "max_batch_per_call": self.max_batch_per_call,
        }
        return JobQueue(self.max_batch, self.step_frames, self.flow.cost, self.gather_s, **waits, **bounds)

    @property
    def cached(self) -> CachedFlow | None:
        """The incremental flow and its page pool, once started (None: every chunk recomputes)."""
        return self.flow.cached

    def start(self) -> None:
        """Start the worker's thread(s), first giving the incremental flow its pages; idempotent."""
        if self.flow.cached is None:
            self.flow.cached = self._cached_flow()
        if self._thread is None:
            if self._stopped:  # started again after stop(), which closed the queue
                self._queue = self._new_queue()
            self._stopped = False
            self._thread = threading.Thread(target=self._work, name="token2wav", daemon=True)
            self._thread.start()
            sources = [self.vocoding.hift_runner] if self.vocoding.hift_runner.graphs else []
            if self.cached is not None and self.cached.flow.graphs is not None:
                sources.append(self.cached.flow.graphs)
            self._captures = CaptureThread(sources, lambda: self._own_cuda_stream("flow-captures"))
            self._captures.start()
            if self.overlap_hift:
                self._vocoder = threading.Thread(target=self._vocode_work, name="token2wav-hift", daemon=True)
                self._vocoder.start()

    def capture_graphs(self) -> int:
        """Capture the CUDA graphs of a graphed flow estimator for the dtype this worker runs it in
        (graphs.py); call before start(). Returns the graphs captured (0 without graphs)."""
        return capture_estimator_graphs(self.model, self.autocast_dtype)

    def stop(self) -> None:
        """Stop and join the worker; queued jobs fail with RuntimeError. Idempotent."""
        if self._thread is not None:
            self._stopped = True
            left = self._queue.close()
            self._thread.join()  # its last step is handed over before it ends
            self._thread = None
            if self._captures is not None:
                self._captures.stop()
            if self._vocoder is not None:
                self._handoff.put(None)
                self._vocoder.join()
                self._vocoder = None
            for job in left:
                job.resolve(error=RuntimeError("the token2wav worker was stopped"))

    @property
    def pending_captures(self) -> int:
        """Incremental-flow graph buckets and HiFT shapes met and not yet captured (capturing.py)."""
        return self._captures.pending if self._captures is not None else 0

    async def graphs_settled(self) -> None:
        """Return once every incremental-flow graph bucket and HiFT shape met so far is captured
        (warm-ups wait)."""
        while self.pending_captures:
            await asyncio.sleep(0.01)

    async def compiles_settled(self, note_s: float = 30.0) -> None:
        """Return once --compile-flow's compiles of the calls met so far and the captures after them are
        done (compiling.py): benchmarks of the compiled flow wait here, serving does not. A wait logs
        what it waits for every ``note_s``: from a cold inductor cache the estimator's compile alone
        took 213 s on an H100, and a wait that said nothing was once read as a hung start."""
        started = noted = time.monotonic()
        while not COMPILER.settled or self.pending_captures:
            await asyncio.sleep(0.05)
            if time.monotonic() - noted >= note_s:
                noted = time.monotonic()
                c = COMPILER.counters()
                logger.info(
                    "waiting %.0f s for the compile thread: %d compiled in %.0f s, %d to go; %d captures",
                    noted - started,
                    c["flow_compiles"],
                    c["flow_compile_seconds"],
                    COMPILER.outstanding,
                    self.pending_captures,
                )

    def stats(self) -> Token2WavStats:
        """A snapshot of the counters."""
        cached = self.cached.counters() if self.cached is not None else {}
        held = self.lm_yield.counters() if self.lm_yield is not None else {}
        queue = {"queue_depth": len(self._queue), **self._queue.counters()}
        return replace(self._stats, **queue, **cached, **held, **COMPILER.counters())

    def open_stream(
        self, prompt: PromptInputs, speed: float = 1.0, streaming: bool = True, seed: int | None = None
    ) -> Stream:
        """A stream for one sentence in `prompt`'s voice; `seed` drives its HiFT noise (None: random).

        Raises ValueError if `speed` is not positive, or so high that the first streaming chunk would
        be shorter than HiFT's 8-frame cache.
        """
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        if streaming and math.floor((TOKEN_MEL_RATIO * self.first_hop - 1) / speed) <= MEL_CACHE_FRAMES:
            raise ValueError(f"speed {speed} is too high for streaming with a first hop of {self.first_hop}")
        stream = Stream(prompt, speed, streaming, seed, self.first_hop, self.submit, self.expect)
        self._queue.open(stream)
        if self.lm_yield is not None:
            self.lm_yield.add(stream)
        return stream

    async def whole_clip(
        self, prompt: PromptInputs, tokens: list[int], speed: float = 1.0, seed: int | None = None
    ) -> np.ndarray:
        """Non-streaming audio of `tokens` in one job: float32 (480 * 2G / speed,) at 24 kHz."""

        async def all_at_once() -> AsyncIterator[list[int]]:
            yield list(tokens)

        stream = self.open_stream(prompt, speed, streaming=False, seed=seed)
        pieces = [piece async for piece in stream.run(all_at_once())]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    def expect(self, stream: Stream, soon: bool) -> None:
        """Whether ``stream``'s next job is a token or two away: a step waits for it (scheduler.py)."""
        self._queue.expect(stream, soon)

    def submit(self, job: Job) -> None:
        """Queue a job for the worker. Raises RuntimeError after stop()."""
        if self._stopped:
            raise RuntimeError("the token2wav worker is stopped")
        self._submitted += 1
        self._queue.put(job)

    async def together(self, calls: list[Awaitable], jobs: int, wait_s: float = 10.0) -> list:
        """Await `calls` (whole_clip or stream coroutines) so that their first `jobs` jobs reach the
        worker as one batch: the worker holds its next step until they are all queued (or a call
        ends early, or `wait_s` passes), so the batch does not depend on thread timing."""
        target = self._submitted + min(jobs, self.max_batch)
        tasks = [asyncio.ensure_future(call) for call in calls]
        self._queue.hold()
        try:
            until = time.monotonic() + wait_s
            while self._submitted < target and not any(t.done() for t in tasks) and time.monotonic() < until:
                await asyncio.sleep(0.001)
        finally:
            self._queue.release()
        return await asyncio.gather(*tasks)

    def _work(self) -> None:
        """The flow thread: each step's jobs through the flow, then to HiFT (here, or handed over)."""
        dtype = self.model.flow.input_embedding.weight.dtype
        with torch.inference_mode(), self._own_cuda_stream("flow"):
            while (jobs := self._queue.take()) is not None:
                live = [job for job in jobs if job.stream.live]
                self._stats.jobs_dropped += len(jobs) - len(live)
                for job in live:
                    with failing([job], "prompt upload"):
                        job.stream.attach(self.model.device, dtype)
                # A hold this thread never hands on (it failed) ends at its own end time (gate.py).
                hold = self.lm_yield.hold(live) if self.lm_yield is not None else None
                self.flow.run([job for job in live if job.stream.live])
                if self.overlap_hift:
                    self._handoff.put((live, hold))  # waits while HANDOFF_STEPS steps are ahead of HiFT
                    if hold is not None:  # the first chunks' audio before the next flow call (yielding.py)
                        hold.done.wait(max(0.0, hold.until - time.monotonic()))
                else:
                    self._vocode(live, hold)

    def _vocode_work(self) -> None:
        """The HiFT thread (overlap_hift): each handed-over step, in the order the flow finished them."""
        with torch.inference_mode(), self._own_cuda_stream("hift", first=self.hift_first):
            while (handed := self._handoff.get()) is not None:
                self._vocode(*handed)

    def _vocode(self, jobs: list[Job], hold: Hold | None) -> None:
        """HiFT for a flow step's jobs, then the end of the LM's hold for them (yielding.py)."""
        try:
            self.vocoding.step(jobs)
        finally:
            if hold is not None:
                self.lm_yield.release(hold)

    def _own_cuda_stream(self, role: str, first: bool = False):
        """On a GPU, the calling thread's work on a CUDA stream of its own: the flow and HiFT threads'
        kernels then overlap. A mel crosses between them only after its flow call has synchronised
        (flow_steps.py), and HiFT's inputs are freed after its copy to the CPU waited
        for them, so no tensor is read or reused while the other stream still works on it."""
        dev = self.model.device
        if dev.type != "cuda":
            return contextlib.nullcontext()
        # ``first``: one priority higher (a lower number; torch clamps it to the device's range).
        return torch.cuda.stream(role_stream(role, dev, self.stream_priority - first))
