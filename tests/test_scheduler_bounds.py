"""A step's padded bound beyond step_frames: whole clips' own while no stream streams, and a larger
one while the most urgent job's stream has been dry for a second (scheduler.py)."""

import gc
import time

import torch
from scheduling import recompute_cost, zero_stream

from cosyapp.engine.token2wav.scheduler import JobQueue
from cosyapp.engine.token2wav.stream import Job, Stream


def _job(loop, stream: Stream, tokens: int, finalize: bool = False, at: float | None = None) -> Job:
    job = Job(stream, torch.zeros(tokens, dtype=torch.long), 0, finalize, loop.create_future())
    if at is not None:
        job.submitted_at = at
    return job


def test_steps_of_whole_clips_reach_their_own_bound_while_no_stream_streams(loop):
    def clips(queue, count=6):  # 240 padded frames each
        for _ in range(count):
            clip = _job(loop, zero_stream(streaming=False), 100)
            queue.open(clip.stream)
            queue.put(clip)

    queue = JobQueue(8, 500, recompute_cost, whole_step_frames=1000, whole_grace_s=0.3)
    clips(queue)
    assert len(queue.take()) == 4  # 4 x 240 within 1000: no stream streams
    assert len(queue.take()) == 2
    streaming = zero_stream()
    queue.open(streaming)  # opened, not yet run: its first chunk may come any moment
    clips(queue)
    assert len(queue.take()) == 2  # 2 x 240 within 500
    streaming.cancelled.set()  # its run() ended, however it ended: the next sentence's may follow
    assert len(queue.take()) == 2
    time.sleep(0.3)  # none followed: whole-clip steps again
    clips(queue)
    assert len(queue.take()) == 4
    # A stream freed before any step saw it end counts as ended then (a grace no slow machine outlasts).
    queue = JobQueue(8, 500, recompute_cost, whole_step_frames=1000, whole_grace_s=60.0)
    clips(queue)
    assert len(queue.take()) == 4  # no stream has ended yet
    freed = zero_stream()
    queue.open(freed)
    del freed
    gc.collect()
    clips(queue)
    assert len(queue.take()) == 2
    # Without a bound of their own, whole clips keep to the step's.
    plain = JobQueue(8, 500, recompute_cost)
    clips(plain)
    assert len(plain.take()) == 2


def test_a_step_led_by_a_stream_dry_for_a_second_reaches_the_late_bound(loop):
    def finals(queue, stream_of, count=6):  # 240 padded frames each
        for _ in range(count):
            final = _job(loop, stream_of(), 100, finalize=True)
            queue.open(final.stream)
            queue.put(final)

    queue = JobQueue(8, 500, recompute_cost, late_step_frames=1000)
    finals(queue, lambda: zero_stream(dry_in=-0.2))  # dry, but not for a second yet
    assert len(queue.take()) == 2  # 2 x 240 within 500
    assert queue.counters()["late_steps"] == 0
    late_streams = [zero_stream(dry_in=-1.5) for _ in range(6)]
    finals(queue, iter(late_streams).__next__)
    assert len(queue.take()) == 4  # led by a late stream: 4 x 240 within 1000
    assert queue.counters()["late_steps"] == 1
    # The most urgent job decides: a first chunk (no audio yet) submitted before the late streams
    # went dry leads the step, which keeps to step_frames.
    first = _job(loop, zero_stream(), 100, finalize=True, at=time.monotonic() - 10)
    queue.put(first)
    assert len(queue.take()) == 2
    # Without a larger late bound, late streams keep to the step's.
    plain = JobQueue(8, 500, recompute_cost)
    finals(plain, lambda: zero_stream(dry_in=-1.5))
    assert len(plain.take()) == 2 and plain.counters()["late_steps"] == 0


def test_max_batch_bounds_each_flow_call_with_max_batch_per_call(loop):
    def chunks(queue, finalize, count):  # 240 padded frames each, one stream each
        jobs = [_job(loop, zero_stream(dry_in=0.5), 100, finalize=finalize) for _ in range(count)]
        for job in jobs:
            queue.put(job)
        return jobs

    def middle_and_last(queue):  # 4 middle chunks and 4 last chunks: two flow calls' worth
        chunks(queue, False, 4)
        chunks(queue, True, 4)

    def calls(batch):  # rows per flow call (the cost's group)
        return sorted(sum(1 for job in batch if job.finalize == f) for f in (False, True))

    # Without it, max_batch bounds the step's jobs: 4 of the 8, whichever calls they join.
    plain = JobQueue(4, 10_000, recompute_cost)
    middle_and_last(plain)
    assert len(plain.take()) == 4 and len(plain.take()) == 4
    # With it, each call's rows: 4 middle chunks and 4 last chunks in one step, as two calls of 4.
    queue = JobQueue(4, 10_000, recompute_cost, max_batch_per_call=True)
    middle_and_last(queue)
    assert calls(queue.take()) == [4, 4] and len(queue) == 0
    # A call never passes max_batch rows: 6 last chunks go as 4, then 2, and a stream left behind
    # keeps its later job for the next step.
    jobs = chunks(queue, True, 6)
    later = _job(loop, jobs[5].stream, 100, finalize=True)
    queue.put(later)
    assert calls(queue.take()) == [0, 4]
    assert queue.take() == [jobs[4], jobs[5], later]  # the rounds of one step run them in turn
    # The padded bound still holds per call: 4 x 240 within 1000, a fifth would pass it.
    bounded = JobQueue(8, 1000, recompute_cost, max_batch_per_call=True)
    middle_and_last(bounded)
    assert calls(bounded.take()) == [4, 4]
    chunks(bounded, True, 5)
    assert calls(bounded.take()) == [0, 4]
