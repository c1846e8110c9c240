"""A step with no urgent job waits for a fuller batch (fill_s), and no longer than an urgent job allows."""

import threading
import time

import pytest
import torch
from scheduling import PROMPT_TOKENS, recompute_cost, zero_stream

from cosyapp.engine.token2wav.scheduler import FILL_MARGIN_S, JobQueue
from cosyapp.engine.token2wav.stream import Job, Stream

FILL_S = 2.0


def _job(loop, stream: Stream, tokens: int = 128, finalize: bool = False) -> Job:
    return Job(stream, torch.zeros(tokens, dtype=torch.long), 78, finalize, loop.create_future())


def _queue(*jobs: Job, max_batch: int = 3, fill_s: float = FILL_S, step_frames: int = 10**6) -> JobQueue:
    queue = JobQueue(max_batch, step_frames, recompute_cost, fill_s=fill_s)
    for job in jobs:
        queue.put(job)
    return queue


def _timed_take(queue: JobQueue) -> tuple[list[Job] | None, float]:
    started = time.monotonic()
    return queue.take(), time.monotonic() - started


def _put_later(queue: JobQueue, job: Job, after_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after_s), queue.put(job)))
    thread.start()
    return thread


def test_a_step_of_streams_with_audio_to_spare_waits_to_fill_then_goes_when_full(loop):
    spare = [_job(loop, zero_stream(dry_in=5.0)) for _ in range(3)]
    queue = _queue(spare[0])
    late = [_put_later(queue, spare[1], 0.05), _put_later(queue, spare[2], 0.15)]
    batch, took = _timed_take(queue)
    for thread in late:
        thread.join()
    assert batch == spare  # all three in one step ...
    assert 0.1 <= took < FILL_S  # ... which went once max_batch (3) had come (the last came at 0.15 s)
    assert queue.counters()["fills"] == 1 and 0.1 <= queue.counters()["fill_seconds"] < FILL_S


def test_a_step_that_does_not_fill_goes_after_fill_s_with_what_it_has(loop):
    alone = _job(loop, zero_stream(dry_in=5.0))
    batch, took = _timed_take(_queue(alone))
    assert batch == [alone] and took >= FILL_S


@pytest.mark.parametrize(
    ("what", "stream"),
    [
        ("a first chunk", lambda: zero_stream(dry_in=None)),
        ("a whole clip", lambda: zero_stream(streaming=False)),
        ("a stream about to run dry", lambda: zero_stream(dry_in=FILL_MARGIN_S / 2)),
    ],
)
def test_an_urgent_job_takes_its_step_at_once(loop, what, stream):
    spare, urgent = _job(loop, zero_stream(dry_in=5.0)), _job(loop, stream())
    batch, took = _timed_take(_queue(spare, urgent))
    assert set(map(id, batch)) == {id(spare), id(urgent)}, what
    assert took < FILL_S / 3, what


def test_a_stream_already_dry_is_not_urgent_its_step_fills(loop):
    dry = _job(loop, zero_stream(dry_in=-0.5))
    batch, took = _timed_take(_queue(dry))
    assert batch == [dry] and took >= FILL_S


def test_an_urgent_job_that_comes_during_the_fill_ends_it(loop):
    spare, first = _job(loop, zero_stream(dry_in=5.0)), _job(loop, zero_stream(dry_in=None), tokens=28)
    queue = _queue(spare)
    thread = _put_later(queue, first, 0.1)
    batch, took = _timed_take(queue)
    thread.join()
    assert batch == [spare, first] and 0.05 <= took < FILL_S / 2


def test_without_fill_a_step_goes_at_once_and_closing_ends_a_fill(loop):
    spare = _job(loop, zero_stream(dry_in=5.0))
    batch, took = _timed_take(_queue(spare, fill_s=0.0))
    assert batch == [spare] and took < FILL_S / 3
    queue = _queue(_job(loop, zero_stream(dry_in=5.0)), fill_s=30.0)
    closer = threading.Thread(target=lambda: (time.sleep(0.1), queue.close()))
    closer.start()
    batch, took = _timed_take(queue)
    closer.join()
    assert batch is None and took < 5.0


def test_a_step_its_padded_bound_fills_goes_at_once(loop):
    spare = [_job(loop, zero_stream(dry_in=5.0)) for _ in range(3)]
    one_job = 2 * (PROMPT_TOKENS + 128)
    batch, took = _timed_take(_queue(*spare, max_batch=8, step_frames=2 * one_job))
    assert batch == spare[:2] and took < FILL_S / 3  # two fit, the third waits for the next step
