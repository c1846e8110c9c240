"""The shared token2wav worker on the tiny model (CPU): chunk schedule, batching, caches, cancellation."""

import asyncio
import threading
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cosyapp.engine.token2wav.chunking import ChunkSchedule, StreamingSpeedChange
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.models.cosyvoice2 import PromptInputs

SAMPLES_PER_TOKEN = 960  # 2 mel frames of 480 samples
CACHE = 3840  # samples each chunk call holds back for the next chunk's cross-fade


def _prompt(prompt_len: int, seed: int) -> PromptInputs:
    g = torch.Generator().manual_seed(seed)
    return PromptInputs(
        text_ids=torch.tensor([1, 2, 3]),
        speech_tokens=torch.randint(0, 6561, (prompt_len,), generator=g),
        speech_feat=torch.randn(2 * prompt_len, 80, generator=g) * 2 - 5,
        embedding=torch.randn(192, generator=g),
    )


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 6561, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _as_lm(tokens: list[int], piece: int = 7) -> AsyncIterator[list[int]]:
    """Hand the tokens over in small lists, yielding to the event loop in between, as an LM engine does."""
    for i in range(0, len(tokens), piece):
        yield tokens[i : i + piece]
        await asyncio.sleep(0)


async def _collect(engine: Token2Wav, prompt_len: int, count: int, seed: int, **options) -> list[np.ndarray]:
    stream = engine.open_stream(_prompt(prompt_len, seed), seed=seed, **options)
    return [chunk async for chunk in stream.run(_as_lm(_tokens(count, seed)))]


def _run(model, main, **options) -> object:
    """Run `main(engine)` on a started engine (Token2Wav ``options``) and stop it afterwards."""

    async def runner():
        engine = Token2Wav(model, **options)
        engine.start()
        try:
            return await main(engine)
        finally:
            engine.stop()

    return asyncio.run(runner())


def _hops(schedule: ChunkSchedule, available: int) -> list[int]:
    hops = []
    while schedule.ready(available):
        start, end = schedule.advance()
        hops.append(end - start)
    return hops


@pytest.mark.parametrize("prompt_len, pad", [(25, 0), (37, 13), (49, 1), (12, 13)])
def test_hops_are_25_plus_pad_then_50_then_100_each_call_ending_on_an_encoder_chunk(prompt_len, pad):
    schedule = ChunkSchedule(prompt_len)
    ends = []
    while schedule.ready(350):
        ends.append(prompt_len + schedule.advance()[1])
    assert np.diff([prompt_len, *ends]).tolist() == [25 + pad, 50, 100, 100]
    assert all(end % 25 == 0 for end in ends)


def test_a_smaller_first_hop_realigns_every_later_call_to_an_encoder_chunk():
    schedule = ChunkSchedule(prompt_len=37, first_hop=10)
    assert _hops(schedule, 400) == [23, 40, 50, 100, 100]  # calls end at 60, 100, 150, 250, 350


@pytest.mark.parametrize("prompt_len, count", [(25, 27), (25, 28), (49, 90), (12, 140)])
def test_streamed_chunks_add_up_to_the_non_streaming_length(tiny_model, prompt_len, count):
    async def main(engine):
        streamed = await _collect(engine, prompt_len, count, seed=count)
        whole = await _collect(engine, prompt_len, count, seed=count, streaming=False)
        return streamed, whole

    streamed, whole = _run(tiny_model, main)
    assert sum(map(len, streamed)) == SAMPLES_PER_TOKEN * count
    assert [len(w) for w in whole] == [SAMPLES_PER_TOKEN * count]


def test_every_stream_starts_its_own_schedule_at_25_plus_pad(tiny_model):
    async def main(engine):
        return [await _collect(engine, prompt_len, 300, seed=i) for i, prompt_len in enumerate((37, 25))]

    first, second = _run(tiny_model, main)
    # Hops 25 + 13, 50, 100, 100, then the final 12 tokens (+ the 8 held-back frames).
    assert [len(c) for c in first] == [960 * 38 - CACHE, 960 * 50, 960 * 100, 960 * 100, 960 * 12 + CACHE]
    # A second stream in the same process starts over at 25 (+ pad 0), not at the first one's 100.
    assert [len(c) for c in second] == [960 * 25 - CACHE, 960 * 50, 960 * 100, 960 * 100, 960 * 25 + CACHE]


def test_non_streaming_output_equals_the_batch_1_reference_path(tiny_model):
    tokens, prompt = _tokens(120, seed=4), _prompt(37, seed=4)

    async def main(engine):
        return await engine.whole_clip(prompt, tokens, seed=9)

    audio = _run(tiny_model, main)
    mel = tiny_model.tokens_to_mel(torch.tensor(tokens), prompt)
    with torch.inference_mode():
        reference, _ = tiny_model.hift(mel[None], generators=[torch.Generator().manual_seed(9)])
    assert np.array_equal(audio, reference[0].numpy())


def test_calls_awaited_together_reach_a_running_worker_as_one_batch(tiny_model):
    prompt = _prompt(37, seed=5)

    async def main(engine):
        sizes = []
        for count in (3, 2, 4):
            await engine.together(
                [engine.whole_clip(prompt, _tokens(60 + 10 * i, seed=i), seed=i) for i in range(count)], count
            )
            sizes.append(engine.stats().last_flow_batch)
        return sizes

    # Four calls on a worker of max_batch 3: three at once, then the one left over.
    assert _run(tiny_model, main, max_batch=3) == [3, 2, 1]


def test_concurrent_streams_are_batched_and_each_sounds_as_when_run_alone(tiny_model):
    # (prompt_len, tokens, options): two same-length prompts give equal HiFT lengths, so HiFT batches too.
    specs = [(37, 140, {}), (37, 90, {}), (50, 200, {"speed": 0.5}), (63, 90, {"streaming": False})]

    async def main():
        engine = Token2Wav(tiny_model)  # not started yet: every stream's first job waits in its queue
        together = [
            asyncio.create_task(_collect(engine, p, n, seed=i, **o)) for i, (p, n, o) in enumerate(specs)
        ]
        while engine.stats().queue_depth < len(specs):
            await asyncio.sleep(0)
        engine.start()
        try:
            batched = await asyncio.gather(*together)
            stats = engine.stats()
            alone = [await _collect(engine, p, n, seed=i, **o) for i, (p, n, o) in enumerate(specs)]
        finally:
            engine.stop()
        return batched, alone, stats

    batched, alone, stats = asyncio.run(main())
    assert stats.max_flow_batch > 1 and stats.max_hift_batch > 1
    for together, by_itself in zip(batched, alone, strict=True):
        assert [len(c) for c in together] == [len(c) for c in by_itself]
        # Same noise per stream; padded/batched kernels round differently (measured <= 1.1e-7).
        np.testing.assert_allclose(np.concatenate(together), np.concatenate(by_itself), rtol=0, atol=1e-5)


def test_closing_a_stream_drops_its_pending_jobs_and_other_streams_complete(tiny_model):
    async def main():
        engine = Token2Wav(tiny_model)  # not started: the doomed stream's jobs wait in the queue
        doomed = engine.open_stream(_prompt(37, 1), seed=1).run(_as_lm(_tokens(300, 1)))
        first_chunk = asyncio.create_task(anext(doomed))
        while engine.stats().queue_depth < 5:  # 4 chunks + the final call
            await asyncio.sleep(0)
        first_chunk.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first_chunk
        engine.start()
        try:
            other = await _collect(engine, 20, 60, seed=2)
        finally:
            engine.stop()
        return other, engine.stats()

    other, stats = asyncio.run(main())
    assert sum(map(len, other)) == SAMPLES_PER_TOKEN * 60
    assert stats.jobs_dropped == 5
    assert stats.jobs_done == 2  # the other stream's chunk and final call only


def test_closing_the_audio_closes_the_token_iterator(tiny_model):
    closed = []

    async def lm_still_decoding() -> AsyncIterator[list[int]]:
        try:
            yield _tokens(60, seed=3)
            await asyncio.Event().wait()  # the LM never finishes on its own
        finally:
            closed.append(True)

    async def main(engine):
        audio = engine.open_stream(_prompt(37, 3), seed=3).run(lm_still_decoding())
        first = await anext(audio)
        await audio.aclose()
        return first

    first = _run(tiny_model, main)
    assert len(first) == 960 * 38 - CACHE
    assert closed == [True]


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_scales_the_duration(tiny_model, speed, streaming):
    count = 100

    async def main(engine):
        return await _collect(engine, 37, count, seed=5, speed=speed, streaming=streaming)

    chunks = _run(tiny_model, main)
    assert len(chunks) == (3 if streaming else 1)
    assert sum(map(len, chunks)) == 480 * int(2 * count / speed)


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_streaming_speed_change_does_not_depend_on_where_chunks_are_cut(speed):
    mel = torch.randn(80, 237, generator=torch.Generator().manual_seed(0))
    whole = StreamingSpeedChange(speed).push(mel, final=True)
    cut = StreamingSpeedChange(speed)
    pieces = [cut.push(mel[:, a:b], final=b == 237) for a, b in [(0, 50), (50, 101), (101, 180), (180, 237)]]
    assert torch.equal(torch.cat(pieces, dim=1), whole)
    torch.testing.assert_close(whole, F.interpolate(mel[None], scale_factor=1 / speed, mode="linear")[0])


def test_streamed_audio_is_continuous_at_chunk_boundaries(tiny_model):
    async def main(engine):
        return await _collect(engine, 37, 300, seed=6)

    chunks = _run(tiny_model, main)
    audio = np.concatenate(chunks)
    steps = np.abs(np.diff(audio))
    boundaries = np.cumsum([len(c) for c in chunks])[:-1]
    # Measured: boundary steps 0.003-0.015 against a median step of 0.032 over the whole signal.
    assert len(boundaries) == 4
    assert (steps[boundaries - 1] <= np.median(steps)).all()


def test_hift_on_its_own_thread_gives_every_stream_the_same_audio(tiny_model):
    # Several streams at once, one slowed down and one whole clip, so steps hand over to the HiFT
    # thread while the flow thread runs the next ones.
    specs = [(37, 240, {}), (37, 140, {}), (50, 200, {"speed": 0.5}), (63, 90, {"streaming": False})]

    async def main(engine):
        threads = {t.name for t in threading.enumerate()}
        runs = [_collect(engine, p, n, seed=i, **o) for i, (p, n, o) in enumerate(specs)]
        return threads, await asyncio.gather(*runs), engine.stats()

    _, in_turn, _ = _run(tiny_model, main, overlap_hift=False)
    threads, overlapped, stats = _run(tiny_model, main, overlap_hift=True)
    assert "token2wav-hift" in threads
    assert stats.jobs_done == sum(map(len, overlapped)) and stats.hift_calls >= 2
    for a, b in zip(in_turn, overlapped, strict=True):
        assert [len(c) for c in a] == [len(c) for c in b]
        # Batches may differ with thread timing; batched kernels round differently (as above).
        np.testing.assert_allclose(np.concatenate(a), np.concatenate(b), rtol=0, atol=1e-5)


def test_stopping_with_hift_on_its_own_thread_ends_both_threads(tiny_model):
    async def main():
        engine = Token2Wav(tiny_model, overlap_hift=True, max_batch=1)
        before = set(threading.enumerate())  # other tests' engines may still run in this process
        engine.start()
        threads = set(threading.enumerate()) - before
        runs = [asyncio.create_task(_collect(engine, 37, 300, seed=i)) for i in range(3)]
        while engine.stats().jobs_done < 2:
            await asyncio.sleep(0.01)
        engine.stop()
        results = await asyncio.gather(*runs, return_exceptions=True)
        return results, threads

    results, threads = asyncio.run(main())
    assert {t.name for t in threads} == {"token2wav", "token2wav-hift"}
    assert not [t for t in threads if t.is_alive()]
    # Jobs still queued when it stopped fail with the worker's message; none hangs.
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors and all("stopped" in str(e) for e in errors)


def test_a_hift_group_past_the_frame_bound_runs_in_several_calls_with_the_same_audio(tiny_model):
    # Four whole clips of one length share a HiFT group; a bound of two clips' frames splits it in two.
    prompt = _prompt(37, seed=5)

    def main_with(max_frames):
        async def main(engine):
            if max_frames:
                engine.vocoding.max_frames = max_frames
            clips = [engine.whole_clip(prompt, _tokens(60, seed=i), seed=i) for i in range(4)]
            return await engine.together(clips, len(clips)), engine.stats()

        return main

    unbounded, stats = _run(tiny_model, main_with(None))
    assert (stats.hift_calls, stats.max_hift_batch) == (1, 4)
    # One recompute call over prompt and tokens of each clip; each clip's 120 new frames delivered.
    assert (stats.recompute_frames, stats.recompute_run_frames) == (4 * 120, 4 * 2 * (37 + 60))
    bounded, stats = _run(tiny_model, main_with(2 * 120 + 1))
    assert (stats.hift_calls, stats.max_hift_batch) == (2, 2)
    _, stats = _run(tiny_model, main_with(3 * 120))  # three clips a call at most: two calls of two
    assert (stats.hift_calls, stats.max_hift_batch) == (2, 2)
    for a, b in zip(unbounded, bounded, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)  # batched kernels round differently


def test_whole_clips_share_larger_steps_until_a_stream_streams(tiny_model):
    # Clips of 60 tokens after a 37-token prompt pad a call to 194 frames each: steps of 400 hold two,
    # steps of 800 four, while no stream streams.
    prompt = _prompt(37, seed=5)

    async def main(engine):
        clips = [engine.whole_clip(prompt, _tokens(60, seed=i), seed=i) for i in range(4)]
        await engine.together(clips, len(clips))
        alone = engine.stats().max_flow_batch
        stream = engine.open_stream(prompt, seed=9)  # opened: its first chunk may come any moment
        clips = [engine.whole_clip(prompt, _tokens(60, seed=i), seed=i) for i in range(4)]
        await engine.together(clips, len(clips))
        return alone, engine.stats().last_flow_batch, stream

    alone, beside, _ = _run(tiny_model, main, max_batch=4, step_frames=400, whole_step_frames=800)
    assert (alone, beside) == (4, 2)
