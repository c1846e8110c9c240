"""Streams and costs the scheduler tests share (test_scheduler.py, test_scheduler_fill.py): a stream
on a zero prompt of PROMPT_TOKENS tokens, and the recompute flow's cost of a job."""

import time

import torch

from cosyapp.engine.token2wav.stream import Job, Stream
from cosyapp.models.cosyvoice2 import PromptInputs

PROMPT_TOKENS = 20


def zero_stream(streaming: bool = True, dry_in: float | None = None) -> Stream:
    """A stream on a zero prompt whose listener runs dry ``dry_in`` seconds from now (None: it has
    no audio yet); its jobs go nowhere until a test queues them."""
    prompt = PromptInputs(
        text_ids=torch.tensor([1]),
        speech_tokens=torch.zeros(PROMPT_TOKENS, dtype=torch.long),
        speech_feat=torch.zeros(2 * PROMPT_TOKENS, 80),
        embedding=torch.zeros(192),
    )
    stream = Stream(prompt, 1.0, streaming, 0, 25, submit=lambda job: None)
    if dry_in is not None:
        stream.first_audio_at, stream.audio_seconds = time.monotonic() - 1.0, 1.0 + dry_in
    return stream


def recompute_cost(job: Job) -> tuple[tuple, int]:
    """The recompute flow's (call kind, mel frames) of a job: prompt and tokens at two frames each."""
    return ("recompute", job.streaming, job.finalize), 2 * (PROMPT_TOKENS + len(job.tokens))
