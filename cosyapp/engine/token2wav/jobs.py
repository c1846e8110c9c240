"""The token2wav worker's units of work and how their results reach the streams.

A Job is one flow + HiFT call of one stream; its result (audio or an error) is handed to the
stream's event loop from the worker thread. An error ends only the jobs involved: ``failing`` and
``retry_in_halves`` turn it into those jobs' results (closing their streams), so the worker keeps
serving everyone else.
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from cosyapp.engine.token2wav.chunking import HiFTOverlap, StreamingSpeedChange
from cosyapp.models.cosyvoice2 import PromptInputs

logger = logging.getLogger(__name__)
T = TypeVar("T")  # a batch item: a Job for the flow, (Job, HiFT input mel) for HiFT


@dataclass
class StreamState:
    """One stream's conditioning and vocoder state. The worker thread alone touches the caches."""

    prompt: PromptInputs  # on the model's device
    speed: float
    generator: torch.Generator  # HiFT source noise of this stream only
    resampler: StreamingSpeedChange | None  # streaming speed change; None in non-streaming mode
    overlap: HiFTOverlap = field(default_factory=HiFTOverlap)
    closed: bool = False  # set when the consumer goes away or a job failed: drop its work


@dataclass
class Job:
    """One flow + HiFT call of one stream; the mel kept starts at token `offset`."""

    state: StreamState
    tokens: Tensor  # (n,) long: every token from the start, plus the lookahead in a chunk call
    offset: int
    streaming: bool  # chunk masks in the flow
    finalize: bool  # full sequence, no lookahead; also the stream's last job
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    mel: Tensor | None = field(default=None, repr=False)  # the flow's new frames (80, n)


@contextlib.contextmanager
def failing(jobs: list[Job], what: str) -> Iterator[None]:
    """Turn an error in the block into the result of `jobs` (closing their streams), so it ends only
    the streams involved and the worker keeps serving the others."""
    try:
        yield
    except Exception as error:
        logger.exception("token2wav %s failed for %d jobs", what, len(jobs))
        for job in jobs:
            deliver(job, error=error)


def retry_in_halves(
    batch: list[T], run: Callable[[list[T]], None], jobs_of: Callable[[list[T]], list[Job]], what: str
) -> None:
    """``run(batch)``; when it runs out of device memory, run each half on its own, and so on down to
    single items: only an item that fails alone, or a batch that fails otherwise, gets the error.

    One stream's oversized chunk then costs the others a slower step, not their audio.
    """
    try:
        run(batch)
    except torch.OutOfMemoryError as error:
        if len(batch) == 1:
            logger.error("token2wav %s ran out of memory for a single job", what)
            deliver(jobs_of(batch)[0], error=error)
            return
        logger.warning("token2wav %s ran out of memory for %d jobs; retrying in halves", what, len(batch))
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # hand the failed call's blocks back before the smaller calls
        half = len(batch) // 2
        retry_in_halves(batch[:half], run, jobs_of, what)
        retry_in_halves(batch[half:], run, jobs_of, what)
    except Exception as error:
        logger.exception("token2wav %s failed for %d jobs", what, len(batch))
        for job in jobs_of(batch):
            deliver(job, error=error)


def rounds(jobs: list[Job]) -> Iterator[list[Job]]:
    """Jobs in rounds holding at most one job per stream, each stream's jobs in submission order.

    A stream's chunk k + 1 needs the HiFT caches of chunk k; different streams are independent.
    """
    per_stream: dict[int, list[Job]] = {}
    for job in jobs:
        per_stream.setdefault(id(job.state), []).append(job)
    for k in range(max(map(len, per_stream.values()), default=0)):
        yield [stream_jobs[k] for stream_jobs in per_stream.values() if len(stream_jobs) > k]


def deliver(job: Job, audio: np.ndarray | None = None, error: BaseException | None = None) -> None:
    """Hand a result to the stream's event loop (from any thread); a failed stream is closed."""
    if error is not None:
        job.state.closed = True
    if not job.loop.is_closed():
        job.loop.call_soon_threadsafe(_resolve, job.future, audio, error)


def _resolve(future: asyncio.Future, audio: np.ndarray | None, error: BaseException | None) -> None:
    if future.done():  # cancelled by a consumer that went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(audio)
