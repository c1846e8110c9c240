"""The token2wav worker's choice of jobs: earliest deadline first, bounded steps, streams in order."""

import asyncio
import threading
import time

import numpy as np
import torch
from scheduling import PROMPT_TOKENS, recompute_cost, zero_stream

from cosyapp.engine.token2wav.scheduler import WHOLE_SLACK_S, JobQueue
from cosyapp.engine.token2wav.stream import Job, Stream
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.models.cosyvoice2 import PromptInputs


def _job(loop, stream: Stream, tokens: int, offset: int = 0, finalize: bool = False, at: float | None = None):
    job = Job(stream, torch.zeros(tokens, dtype=torch.long), offset, finalize, loop.create_future())
    if at is not None:
        job.submitted_at = at
    return job


def _queue(*jobs: Job, max_batch: int = 8, step_frames: int = 10**6) -> JobQueue:
    queue = JobQueue(max_batch, step_frames, recompute_cost)
    for job in jobs:
        queue.put(job)
    return queue


def test_a_first_chunk_goes_before_streams_with_audio_to_spare(loop):
    now = time.monotonic()
    playing = zero_stream()
    playing.first_audio_at, playing.audio_seconds = now - 1.0, 5.0  # runs dry in 4 s
    later = _job(loop, playing, 128, offset=78, at=now - 0.5)
    first = _job(loop, zero_stream(), 28, at=now)
    queue = _queue(later, first, max_batch=1)
    assert queue.take() == [first]
    assert queue.take() == [later]


def test_a_stream_about_to_run_dry_goes_before_a_first_chunk(loop):
    now = time.monotonic()
    starving = zero_stream()
    starving.first_audio_at, starving.audio_seconds = now - 3.0, 2.0  # dry a second ago
    first = _job(loop, zero_stream(), 28, at=now)
    behind = _job(loop, starving, 128, offset=78, at=now - 0.2)
    assert _queue(first, behind, max_batch=1).take() == [behind]


def test_a_whole_clip_waits_for_near_gaps_only_up_to_its_slack(loop):
    now = time.monotonic()
    whole = _job(loop, zero_stream(streaming=False), 100, finalize=True, at=now)
    soon, later = zero_stream(), zero_stream()
    soon.first_audio_at, soon.audio_seconds = now, WHOLE_SLACK_S / 2
    later.first_audio_at, later.audio_seconds = now, WHOLE_SLACK_S * 2
    queue = _queue(_job(loop, later, 128, offset=78), whole, _job(loop, soon, 128, offset=78), max_batch=1)
    assert [queue.take()[0].stream for _ in range(3)] == [soon, whole.stream, later]


def test_a_huge_job_runs_in_a_step_of_its_own_and_small_ones_are_not_padded_to_it(loop):
    now = time.monotonic()
    huge = _job(loop, zero_stream(streaming=False), 2000, finalize=True, at=now - 10)  # the most urgent
    small = [_job(loop, zero_stream(streaming=False), 50, finalize=True, at=now) for _ in range(3)]
    queue = _queue(*small, huge, step_frames=3 * 2 * (PROMPT_TOKENS + 50))
    assert queue.take() == [huge]
    assert queue.take() == small


def test_a_step_never_passes_its_padded_size_except_for_a_single_job(loop):
    jobs = [_job(loop, zero_stream(streaming=False), n, finalize=True) for n in (30, 60, 90, 120, 150)]
    budget = 400
    queue = _queue(*jobs, step_frames=budget)
    steps = []
    while len(queue):
        step = queue.take()
        frames = [recompute_cost(job)[1] for job in step]
        assert len(step) == 1 or len(step) * max(frames) <= budget
        steps.append(len(step))
    assert sum(steps) == len(jobs) and max(steps) > 1


def test_a_streams_jobs_leave_in_order_when_one_is_left_for_a_later_step(loop):
    now = time.monotonic()
    stream = zero_stream()
    # Its first chunk cannot share a step with the urgent big job; its next chunk must wait for it.
    first = _job(loop, stream, 28, at=now)
    second = _job(loop, stream, 78, offset=28, at=now + 0.01)
    big = _job(loop, zero_stream(), 600, at=now - 1)
    queue = _queue(first, second, big, step_frames=2 * (PROMPT_TOKENS + 600))
    assert queue.take() == [big]
    assert queue.take() == [first, second]


def test_take_waits_while_held_and_returns_none_once_closed(loop):
    queue = _queue(_job(loop, zero_stream(), 28))
    queue.hold()
    left = []

    async def close_later():
        await asyncio.sleep(0.2)
        left.extend(queue.close())

    async def main():
        closer = asyncio.ensure_future(close_later())
        taken = await asyncio.to_thread(queue.take)
        await closer
        return taken

    assert loop.run_until_complete(main()) is None
    assert len(left) == 1 and len(queue) == 0


def _take_while_putting(queue: JobQueue, jobs: list[Job], gap_s: float) -> tuple[list[Job], float]:
    """An idle worker's ``take`` (on a thread) while ``jobs`` come one by one, ``gap_s`` apart;
    returns its batch and how long it took from the first job."""
    taken: list = []
    worker = threading.Thread(target=lambda: taken.append((queue.take(), time.monotonic())))
    worker.start()
    time.sleep(0.05)  # the worker waits on the empty queue
    first = time.monotonic()
    for job in jobs:
        queue.put(job)
        time.sleep(gap_s)
    worker.join()
    batch, at = taken[0]
    return batch, at - first


def test_an_idle_worker_gathers_the_jobs_that_come_together(loop):
    jobs = [_job(loop, zero_stream(), 28) for _ in range(5)]
    queue = JobQueue(8, 10**6, recompute_cost, gather_s=0.2, gather_max_s=5.0)
    batch, _ = _take_while_putting(queue, jobs, gap_s=0.01)
    assert batch == jobs
    # Without gathering the first job leaves alone: the next comes after the worker has taken it.
    jobs = [_job(loop, zero_stream(), 28) for _ in range(3)]
    queue = JobQueue(8, 10**6, recompute_cost, gather_s=0.0)
    batch, _ = _take_while_putting(queue, jobs, gap_s=0.1)
    assert batch == jobs[:1] and len(queue) == 2


def test_gathering_ends_at_its_cap_or_at_a_full_batch(loop):
    # Jobs that never stop coming: the step leaves at the cap, long before the last job.
    jobs = [_job(loop, zero_stream(), 28) for _ in range(60)]
    queue = JobQueue(100, 10**6, recompute_cost, gather_s=0.2, gather_max_s=0.1)
    batch, after = _take_while_putting(queue, jobs, gap_s=0.02)
    assert 1 <= len(batch) < 30 and after < 0.6
    # A full batch leaves at once, whatever the quiet gap.
    jobs = [_job(loop, zero_stream(), 28) for _ in range(4)]
    queue = JobQueue(4, 10**6, recompute_cost, gather_s=30.0, gather_max_s=30.0)
    batch, after = _take_while_putting(queue, jobs, gap_s=0.0)
    assert batch == jobs and after < 5.0


def test_a_streams_first_audio_is_not_held_behind_a_huge_whole_clip(tiny_model):
    """On the worker: a long whole clip and a new stream arrive together; the stream's first chunk
    runs in its own step first, and its audio is what a stream alone gets."""
    g = torch.Generator().manual_seed(3)
    prompt = PromptInputs(
        text_ids=torch.tensor([1, 2]),
        speech_tokens=torch.randint(0, 6561, (25,), generator=g),
        speech_feat=torch.randn(50, 80, generator=g) - 5,
        embedding=torch.randn(192, generator=g),
    )
    long_tokens = torch.randint(0, 6561, (900,), generator=g).tolist()
    tokens = torch.randint(0, 6561, (60,), generator=g).tolist()
    finished: list[str] = []

    async def whole(engine):
        audio = await engine.whole_clip(prompt, long_tokens, seed=1)
        finished.append("whole")
        return audio

    async def streamed(engine):
        async def feed():
            yield tokens

        chunks = []
        async for chunk in engine.open_stream(prompt, seed=2).run(feed()):
            if not chunks:
                finished.append("first chunk")
            chunks.append(chunk)
        return chunks

    async def main():
        engine = Token2Wav(tiny_model, step_frames=2 * (25 + 900))
        engine.start()
        try:
            # The whole clip's one job and the stream's two (its first chunk and its last) are queued at once.
            _, together = await engine.together([whole(engine), streamed(engine)], 3)
            stats = engine.stats()
            alone = await streamed(engine)
        finally:
            engine.stop()
        return together, alone, stats

    together, alone, stats = asyncio.run(main())
    assert finished[:2] == ["first chunk", "whole"]
    # Three flow calls of one job each: the stream's last chunk was not padded to the whole clip.
    assert (stats.flow_calls, stats.max_flow_batch) == (3, 1)
    np.testing.assert_allclose(np.concatenate(together), np.concatenate(alone), rtol=0, atol=1e-5)


def _take_expecting(queue: JobQueue, first: Job, then: Job | None, after_s: float, waiting: bool = False):
    """A worker's ``take`` (on a thread) with ``first`` queued and ``then``'s stream expected, its job
    put ``after_s`` later (None: the expectation ends instead). ``waiting``: ``first`` was queued
    before the worker looked, as after a step (no idle gathering). Returns the batch and its wait."""
    expected = then.stream if then is not None else zero_stream()
    queue.expect(expected, True)
    if waiting:
        queue.put(first)
    taken: list = []
    worker = threading.Thread(target=lambda: taken.append((queue.take(), time.monotonic())))
    worker.start()
    time.sleep(0.05)
    start = time.monotonic()
    if not waiting:
        queue.put(first)
    time.sleep(after_s)
    if then is not None:
        queue.put(then)
    else:
        queue.expect(expected, False)
    worker.join()
    batch, at = taken[0]
    return batch, at - start


def test_a_step_waits_for_the_job_of_a_stream_it_expects(loop):
    a, b = _job(loop, zero_stream(), 28), _job(loop, zero_stream(), 28)
    queue = JobQueue(8, 10**6, recompute_cost, gather_s=0.002, expect_s=5.0)
    batch, waited = _take_expecting(queue, a, b, after_s=0.3)
    assert batch == [a, b] and waited >= 0.3 and queue.expected == 0
    # Jobs already waiting after a step: the step waits for the expected job too.
    a, b = _job(loop, zero_stream(), 28), _job(loop, zero_stream(), 28)
    queue = JobQueue(8, 10**6, recompute_cost, gather_s=0.002, expect_s=5.0)
    batch, _ = _take_expecting(queue, a, b, after_s=0.3, waiting=True)
    assert batch == [a, b]
    # Expecting nothing (expect_s 0), the quiet gap takes the first job alone.
    a, b = _job(loop, zero_stream(), 28), _job(loop, zero_stream(), 28)
    queue = JobQueue(8, 10**6, recompute_cost, gather_s=0.002, expect_s=0.0)
    batch, _ = _take_expecting(queue, a, b, after_s=0.3)
    assert batch == [a] and len(queue) == 1


def test_expecting_ends_at_its_cap_or_when_the_stream_is_expected_no_more(loop):
    a, b = _job(loop, zero_stream(), 28), _job(loop, zero_stream(), 28)
    queue = JobQueue(8, 10**6, recompute_cost, gather_s=0.002, expect_s=0.2)
    batch, waited = _take_expecting(queue, a, b, after_s=1.0)
    assert batch == [a] and 0.15 <= waited < 0.9
    a = _job(loop, zero_stream(), 28)
    queue = JobQueue(8, 10**6, recompute_cost, gather_s=0.002, expect_s=30.0)
    batch, waited = _take_expecting(queue, a, None, after_s=0.2)  # the stream ended: no job comes
    assert batch == [a] and waited < 5.0


def _prompt(tokens: int, seed: int) -> PromptInputs:
    g = torch.Generator().manual_seed(seed)
    return PromptInputs(
        text_ids=torch.tensor([1, 2]),
        speech_tokens=torch.randint(0, 6561, (tokens,), generator=g),
        speech_feat=torch.randn(2 * tokens, 80, generator=g) - 5,
        embedding=torch.randn(192, generator=g),
    )


def test_a_stream_is_expected_two_tokens_before_each_chunk(tiny_model):
    """A 25-token prompt: chunk calls at 28 tokens (25 + lookahead 3) and 78; the worker is told to
    expect each while 2 or 1 tokens are missing, and no more once the job is in or the stream ends."""
    tokens = torch.randint(0, 6561, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    seen: list[int] = []

    async def main():
        engine = Token2Wav(tiny_model)
        engine.start()

        async def feed():
            for token in tokens:
                seen.append(engine._queue.expected)  # after every token before this one
                yield [token]

        try:
            stream = engine.open_stream(_prompt(25, 5), seed=1)
            async for _ in stream.run(feed()):
                pass
            return engine._queue.expected
        finally:
            engine.stop()

    assert asyncio.run(main()) == 0
    assert [i for i, n in enumerate(seen) if n] == [26, 27, 76, 77]


def test_a_stream_one_lm_step_ahead_shares_its_first_flow_call(tiny_model):
    """Two streams fed one token per 80 ms step, the second one step behind: the leader's first chunk
    waits for the other's and both run in one flow call; without expecting, it leaves alone."""
    tokens = torch.randint(0, 6561, (30,), generator=torch.Generator().manual_seed(6)).tolist()

    async def run(expect_ms: float):
        engine = Token2Wav(tiny_model, gather_ms=2.0, expect_ms=expect_ms)
        engine.start()

        async def feed(delay: float):
            await asyncio.sleep(delay)
            for token in tokens:
                yield [token]
                await asyncio.sleep(0.08)

        async def consume(stream, delay):
            return [chunk async for chunk in stream.run(feed(delay))]

        try:
            streams = [engine.open_stream(_prompt(25, 7 + i), seed=i) for i in range(2)]
            audio = await asyncio.gather(consume(streams[0], 0.0), consume(streams[1], 0.08))
            # One flow call stamps its jobs with one time.
            return audio, {stream.first_job.times["flow_start"] for stream in streams}
        finally:
            engine.stop()

    shared, starts = asyncio.run(run(expect_ms=2000.0))
    assert len(starts) == 1
    alone, starts = asyncio.run(run(expect_ms=0.0))
    assert len(starts) == 2
    for a, b in zip(shared, alone, strict=True):
        np.testing.assert_allclose(np.concatenate(a), np.concatenate(b), rtol=0, atol=1e-5)


def test_no_expecting_leaves_the_quiet_gap_alone_and_later_expectations_are_not_waited_for(loop):
    # expect_s 0: a stream expected changes nothing, the quiet gap ends the gathering.
    a, b = _job(loop, zero_stream(), 28), _job(loop, zero_stream(), 28)
    queue = JobQueue(8, 10**6, recompute_cost, gather_s=0.002, gather_max_s=5.0, expect_s=0.0)
    batch, waited = _take_expecting(queue, a, b, after_s=1.0)
    assert batch == [a] and waited < 0.9
    # A stream expected only after the step's first look does not hold the step: the quiet gap
    # (1 s) ends it, not the expectation (30 s).
    a = _job(loop, zero_stream(), 28)
    queue = JobQueue(8, 10**6, recompute_cost, gather_s=1.0, gather_max_s=5.0, expect_s=30.0)
    later = threading.Timer(0.3, queue.expect, args=(zero_stream(), True))
    later.start()
    batch, waited = _take_while_putting(queue, [a], gap_s=0.0)
    later.join()
    assert batch == [a] and 0.9 <= waited < 4.0
