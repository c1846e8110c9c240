"""One sentence on its way from speech tokens to audio: a Stream and the Jobs it sends the worker.

A Stream holds all of one sentence's token2wav state, so its audio depends only on its own prompt,
tokens and seed, never on which streams share its batches. The event loop and the worker see it
(the worker's flow and HiFT stages may run on two threads, worker.py), and every field has exactly
one writer:

- the event loop (``run``): the tokens so far, the chunk schedule, the futures of submitted jobs,
  whether the worker was told to expect its next job;
- the flow stage: the prompt on the model's device, the noise generator (made there, at the first
  job, before any HiFT call) and the incremental flow's state;
- the HiFT stage: the speed change, the HiFT overlap caches and the audio delivered so far;
- ``failed`` only ever turns True, set by whichever stage a job of the stream failed in.
Only the worker touches device tensors; a job reaches the HiFT stage after its flow stage is done.

They hand over through one channel each way. The loop puts Jobs on the worker's queue and, when the
stream ends for any reason, sets ``cancelled``, a threading.Event the worker only reads (it then
drops the stream's queued jobs); the worker hands every result back with
``loop.call_soon_threadsafe`` on the job's future.
"""

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from cosyapp.engine.token2wav.chunking import (
    PRE_LOOKAHEAD,
    SOON_TOKENS,
    ChunkSchedule,
    HiFTOverlap,
    StreamingSpeedChange,
)
from cosyapp.engine.token2wav.pages import FlowCache
from cosyapp.models.cosyvoice2 import TOKEN_MEL_RATIO, PromptInputs
from cosyapp.models.flow import MAX_MEL_FRAMES


@dataclass(eq=False)
class Job:
    """One flow + HiFT call of one stream; the mel kept starts at token ``offset``."""

    stream: "Stream"
    tokens: Tensor  # (n,) long on the CPU: every token from the start, plus the lookahead in a chunk call
    offset: int
    finalize: bool  # full sequence, no lookahead; also the stream's last job
    future: asyncio.Future
    mel: Tensor | None = field(default=None, repr=False)  # the flow's new frames (80, n), set by the worker
    submitted_at: float = field(default_factory=time.monotonic)  # for the worker's deadlines (scheduler.py)
    # When the worker's stages took it: "flow_start", "flow_end" (its mel ready), "hift_start",
    # "hift_launched" (HiFT's kernels launched), "hift_end" (monotonic; ``stamp``); the stage that sets
    # a stamp is its only writer.
    times: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def streaming(self) -> bool:
        """Chunk masks in the flow: every call of a streaming stream but its final one."""
        return self.stream.streaming and not self.finalize

    def resolve(self, audio: np.ndarray | None = None, error: BaseException | None = None) -> None:
        """Hand the result to the stream's event loop (from any thread); dropped if the stream ended."""
        loop = self.future.get_loop()
        if not loop.is_closed():
            loop.call_soon_threadsafe(_resolve, self.future, audio, error)


def stamp(jobs: list[Job], name: str) -> float:
    """Note the time now as each job's ``name`` stamp; returns it."""
    now = time.monotonic()
    for job in jobs:
        job.times[name] = now
    return now


# The first chunk's way, stamp by stamp (Stream.first_chunk_times).
FIRST_CHUNK_STAMPS = (
    "run",
    "first_tokens",
    "submitted",
    "flow_start",
    "flow_end",
    "hift_start",
    "hift_launched",
    "hift_end",
)


@dataclass(eq=False)
class Stream:
    """One sentence's token-to-wave conversion; made by ``Token2Wav.open_stream``, run once."""

    prompt: PromptInputs  # as the caller gave it (CPU); the worker moves it to the device
    speed: float
    streaming: bool
    seed: int | None  # HiFT source noise; None: a random seed
    first_hop: int
    submit: Callable[[Job], None]  # puts a job on the worker's queue
    # Tells the worker whether this stream's next job is about to come (``_read``; scheduler.py).
    expect: Callable[["Stream", bool], None] | None = None
    # Written by the event loop only.
    schedule: ChunkSchedule = field(init=False)
    tokens: list[int] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)  # the worker only reads it
    started: bool = False
    expected: bool = False  # what ``expect`` was last told
    # Written by the worker's stages (module docstring; the resampler is made here, before any job).
    device_prompt: PromptInputs | None = None
    generator: torch.Generator | None = None
    resampler: StreamingSpeedChange | None = field(init=False)  # streaming speed change only
    overlap: HiFTOverlap = field(default_factory=HiFTOverlap)
    failed: bool = False  # a job of this stream failed: its later jobs are skipped
    flow_cache: "FlowCache | None" = None  # its incremental flow state (cached.py); None: recompute
    flow_cache_refused: bool = False  # the pool could not serve it: recompute from then on
    first_audio_at: float | None = None  # monotonic time its first audio was handed over
    # Written by the event loop: when run() began, when the first tokens came, the first job.
    run_at: float | None = None
    first_tokens_at: float | None = None
    first_job: Job | None = field(default=None, repr=False)
    audio_seconds: float = 0.0  # audio handed over so far

    def __post_init__(self) -> None:
        self.schedule = ChunkSchedule(len(self.prompt.speech_tokens), self.first_hop)
        self.resampler = StreamingSpeedChange(self.speed) if self.streaming and self.speed != 1.0 else None

    # On the event loop.

    async def run(
        self, tokens: AsyncGenerator[list[int], None], on_tokens: Callable[[int], None] | None = None
    ) -> AsyncIterator[np.ndarray]:
        """Consume the LM's token lists; yield float32 24 kHz audio chunks in order.

        ``on_tokens(n)`` is called as each list of n tokens arrives. Chunk jobs are submitted as soon
        as the schedule allows, while earlier chunks are computed. Non-streaming: one chunk at the
        end. No tokens: no audio. However the stream ends (done, failed, closed, or its consumer
        cancelled), the same cleanup runs: the worker drops its queued jobs, results still in flight
        are ignored, and ``tokens`` is closed (which aborts the LM request). Raises what the token
        iterator or the worker raised, and ValueError if the sequence exceeds the flow's frame limit.
        """
        assert not self.started, "a Stream runs once"
        self.started = True
        self.run_at = time.monotonic()
        ready: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
        reader = asyncio.create_task(self._read(tokens, ready, on_tokens))
        reader.add_done_callback(lambda _: ready.put_nowait(None))
        try:
            while (future := await ready.get()) is not None:
                yield await future
            await reader  # raises what the token iterator or the schedule raised
        finally:
            self.cancelled.set()
            for future in self.futures:
                future.cancel()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(
        self,
        tokens: AsyncGenerator[list[int], None],
        ready: asyncio.Queue,
        on_tokens: Callable[[int], None] | None,
    ) -> None:
        # The reader alone iterates `tokens`, so it alone closes them, on every way out.
        async with contextlib.aclosing(tokens):
            try:
                async for new in tokens:
                    if self.first_tokens_at is None:
                        self.first_tokens_at = time.monotonic()
                    if on_tokens is not None:
                        on_tokens(len(new))
                    self.tokens.extend(new)
                    while self.streaming and self.schedule.ready(len(self.tokens)):
                        offset, end = self.schedule.advance()
                        ready.put_nowait(self._submit(self.tokens[: end + PRE_LOOKAHEAD], offset, False))
                    # Expected if the next arrival, as large as this one, may complete the next chunk.
                    due_in = self.schedule.due_in(len(self.tokens))
                    self._expect(self.streaming and due_in <= max(SOON_TOKENS, len(new)))
                if len(self.tokens) > self.schedule.offset:
                    ready.put_nowait(self._submit(self.tokens, self.schedule.offset, True))
            finally:
                self._expect(False)  # however the tokens ended (a failed LM, a frame limit)

    def _expect(self, soon: bool) -> None:
        if soon != self.expected and self.expect is not None:
            self.expected = soon
            self.expect(self, soon)

    def _submit(self, tokens: list[int], offset: int, finalize: bool) -> asyncio.Future:
        frames = TOKEN_MEL_RATIO * (len(self.prompt.speech_tokens) + len(tokens))
        if frames > MAX_MEL_FRAMES:
            raise ValueError(
                f"prompt + speech tokens need {frames} mel frames; the flow handles {MAX_MEL_FRAMES}"
            )
        future = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        self.expected = False  # the queue forgets the expectation when the job is put
        job = Job(self, torch.tensor(tokens, dtype=torch.long), offset, finalize, future)
        self.first_job = self.first_job or job
        self.submit(job)
        return future

    def first_chunk_times(self) -> dict[str, float] | None:
        """The monotonic time of each of FIRST_CHUNK_STAMPS on the first chunk's way (run() began,
        the first tokens came, its job went to the worker, then the worker's stages), once its audio
        has come back; None before. Read on the event loop: the job's future resolved after the
        stages wrote their stamps."""
        job = self.first_job
        if job is None or not job.future.done() or "hift_end" not in job.times:
            return None
        stamps = {"run": self.run_at, "first_tokens": self.first_tokens_at, "submitted": job.submitted_at}
        return {name: stamps.get(name, job.times.get(name)) for name in FIRST_CHUNK_STAMPS}

    # On the worker's threads.

    @property
    def live(self) -> bool:
        """Whether the worker still computes this stream's jobs: not ended by its consumer, not failed."""
        return not self.failed and not self.cancelled.is_set()

    def attach(self, device: torch.device, dtype: torch.dtype) -> PromptInputs:
        """The prompt on the model's device, and the noise generator; made at the stream's first job."""
        if self.device_prompt is None:
            self.device_prompt = PromptInputs(
                text_ids=self.prompt.text_ids,
                speech_tokens=self.prompt.speech_tokens.to(device),
                speech_feat=self.prompt.speech_feat.to(device, dtype),
                embedding=self.prompt.embedding.to(device, dtype),
            )
            self.generator = torch.Generator(device)
            if self.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.seed)
        return self.device_prompt

    def hift_input(self, job: Job) -> Tensor:
        """The mel HiFT gets for ``job``: the cached overlap frames, then the new (speed-changed) frames.

        Speed: in streaming mode each chunk's new frames go through the stream's running resampler,
        and the caches hold frames and samples of the stretched signal, so chunk boundaries, the
        8-frame overlap and the sample accounting work on the stretched mel exactly as on an
        unstretched one. In non-streaming mode the whole mel is interpolated once, as upstream.
        """
        mel = job.mel
        assert mel is not None
        if self.resampler is not None:
            mel = self.resampler.push(mel, final=job.finalize)
        elif self.speed != 1.0:
            mel = F.interpolate(mel[None], size=int(mel.shape[1] / self.speed), mode="linear")[0]
        return self.overlap.mel_input(mel)

    @property
    def dry_at(self) -> float | None:
        """When its listener runs out of the audio handed over so far (monotonic); None before any."""
        return None if self.first_audio_at is None else self.first_audio_at + self.audio_seconds

    def delivered(self, seconds: float) -> None:
        """Count audio handed to the consumer, for the deadline of its next job (scheduler.py)."""
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
        self.audio_seconds += seconds


def _resolve(future: asyncio.Future, audio: np.ndarray | None, error: BaseException | None) -> None:
    if future.done():  # cancelled by a consumer that went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(audio)
