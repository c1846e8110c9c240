"""How the token2wav worker runs jobs: an error turned into the result of only the jobs involved,
and the recompute path's padded flow call (``recompute``).

``failing`` and ``retry_in_halves`` hand an error to the jobs it concerns (failing their streams, so
their later jobs are skipped), so the worker keeps serving everyone else; ``rounds`` orders a batch
so that each stream's jobs run one after the other. Everything here runs on the worker's threads.
"""

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from cosyapp.engine.token2wav.stats import Token2WavStats
from cosyapp.engine.token2wav.stream import Job
from cosyapp.engine.token2wav.turns import empty_cache_in_turn
from cosyapp.models.cosyvoice2 import TOKEN_MEL_RATIO, CosyVoice2

logger = logging.getLogger(__name__)
T = TypeVar("T")  # a batch item: a Job for the flow, (Job, HiFT input mel) for HiFT


def fail(job: Job, error: BaseException) -> None:
    """End ``job``'s stream with ``error``: its consumer gets the error, its later jobs are skipped."""
    job.stream.failed = True
    job.resolve(error=error)


@contextlib.contextmanager
def failing(jobs: list[Job], what: str) -> Iterator[None]:
    """Turn an error in the block into the result of `jobs` (failing their streams), so it ends only
    the streams involved and the worker keeps serving the others."""
    try:
        yield
    except Exception as error:
        logger.exception("token2wav %s failed for %d jobs", what, len(jobs))
        for job in jobs:
            fail(job, error)


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
            fail(jobs_of(batch)[0], error)
            return
        logger.warning("token2wav %s ran out of memory for %d jobs; retrying in halves", what, len(batch))
        empty_cache_in_turn()  # hand the failed call's blocks back before the smaller calls (in its turn)
        half = len(batch) // 2
        retry_in_halves(batch[:half], run, jobs_of, what)
        retry_in_halves(batch[half:], run, jobs_of, what)
    except Exception as error:
        logger.exception("token2wav %s failed for %d jobs", what, len(batch))
        for job in jobs_of(batch):
            fail(job, error)


def rounds(jobs: list[Job]) -> Iterator[list[Job]]:
    """Jobs in rounds holding at most one job per stream, each stream's jobs in submission order.

    A stream's chunk k + 1 needs the HiFT caches of chunk k; different streams are independent.
    """
    per_stream: dict[int, list[Job]] = {}
    for job in jobs:
        per_stream.setdefault(id(job.stream), []).append(job)
    for k in range(max(map(len, per_stream.values()), default=0)):
        yield [stream_jobs[k] for stream_jobs in per_stream.values() if len(stream_jobs) > k]


def recompute(
    model: CosyVoice2,
    autocast_dtype: torch.dtype | None,
    jobs: list[Job],
    streaming: bool,
    finalize: bool,
    stats: Token2WavStats | None = None,
) -> list[Tensor]:
    """One padded flow call over prompt + every token of each job (all of one mode): each job's new
    frames (80, n) in float32, from its token ``offset`` on. Counts its frames in ``stats``."""
    dev = model.device
    prompts = [job.stream.device_prompt for job in jobs]
    with torch.autocast(dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        mel, mel_len = model.flow.inference(
            token=pad_sequence([job.tokens for job in jobs], batch_first=True).to(dev),
            token_len=torch.tensor([len(job.tokens) for job in jobs], device=dev),
            prompt_token=pad_sequence([p.speech_tokens for p in prompts], batch_first=True),
            prompt_token_len=torch.tensor([len(p.speech_tokens) for p in prompts], device=dev),
            prompt_feat=pad_sequence([p.speech_feat for p in prompts], batch_first=True),
            prompt_feat_len=torch.tensor([len(p.speech_feat) for p in prompts], device=dev),
            embedding=torch.stack([p.embedding for p in prompts]),
            streaming=streaming,
            finalize=finalize,
        )
    mels = [mel[i, :, TOKEN_MEL_RATIO * job.offset : int(mel_len[i])].float() for i, job in enumerate(jobs)]
    if stats is not None:
        lengths = [len(p.speech_tokens) + len(job.tokens) for p, job in zip(prompts, jobs, strict=True)]
        stats.recompute_run_frames += TOKEN_MEL_RATIO * max(lengths) * len(jobs)
        stats.recompute_frames += sum(m.shape[1] for m in mels)
    return mels
