"""HiFT calls through HiFTRunner: padded to a batch bucket, draws made ahead, outputs copied out.

On a CPU the runner's ``capture=False`` mode does everything a replay does (bucket, static buffers,
copies in and out, padding rows holding an earlier call's values) except the CUDA capture itself,
and runs the padded call eagerly; the GPU replays the same padded call from a graph."""

import contextlib
import time

import torch

from cosyapp.engine.token2wav.capturing import CaptureThread
from cosyapp.engine.token2wav.hift_graphs import BATCH_BUCKETS, HiFTRunner
from cosyapp.models.hift import ConvRNNF0Predictor, HiFTGenerator


def tiny_hift() -> HiFTGenerator:
    torch.manual_seed(0)
    return HiFTGenerator(base_channels=32, f0_predictor=ConvRNNF0Predictor(cond_channels=32)).eval()


def call(batch: int, frames: int, seed: int, cached: int = 0):
    g = torch.Generator().manual_seed(seed)
    mel = torch.randn(batch, 80, frames, generator=g) * 2 - 5
    cache = torch.randn(batch, 1, cached, generator=g) * 0.1 if cached else None
    return mel, cache, [seed * 10 + i for i in range(batch)]


def generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_padded_calls_give_each_stream_its_own_audio_and_noise():
    hift = tiny_hift()
    runner = HiFTRunner(hift, graphs=True, capture=False)
    # Calls of one shape share a bucket (4 rows): the first runs eagerly, the second captures, the third's
    # padding row holds the second's values.
    with torch.inference_mode():
        for batch, seed in ((4, 1), (4, 2), (3, 3)):
            mel, cache, seeds = call(batch, 7, seed, cached=960)
            through = generators(seeds)
            speech, source = runner(mel, cache, through)
            direct = generators(seeds)
            expected_speech, expected_source = hift(mel, cache, generators=direct)
            # batched convolutions round differently at 4 rows than at 2 or 3 (<= 1e-6)
            torch.testing.assert_close(speech, expected_speech, rtol=0, atol=1e-6)
            torch.testing.assert_close(source, expected_source, rtol=0, atol=1e-6)
            states = zip(through, direct, strict=True)
            assert all(torch.equal(a.get_state(), b.get_state()) for a, b in states)
    assert runner.replays == 2 and len(runner._graphs) == 1


def test_each_length_and_cache_gets_its_own_shape_and_uncovered_calls_run_eagerly():
    hift = tiny_hift()
    runner = HiFTRunner(hift, graphs=True, capture=False, max_graphs=2, max_cells=2 * 6)
    with torch.inference_mode():
        # each shape twice (its second call captures it); the last one is past max_graphs; a length
        # met once stays eager
        for frames, cached in ((5, 0), (5, 0), (6, 0), (6, 0), (3, 0), (5, 960), (5, 960)):
            mel, cache, seeds = call(2, frames, frames + cached, cached)
            speech, _ = runner(mel, cache, generators(seeds))
            assert speech.shape == (2, 480 * frames)
        too_many, too_long = BATCH_BUCKETS[-1] + 1, 7
        for batch, frames in ((too_many, 2), (too_many, 2), (2, too_long), (2, too_long)):
            mel, cache, seeds = call(batch, frames, 9)
            runner(mel, cache, generators(seeds))
    assert runner.replays == 2 and sorted(key[2:4] for key in runner._graphs) == [(5, 0), (6, 0)]


def test_without_graphs_or_off_cuda_the_runner_is_the_model():
    hift = tiny_hift()
    mel, cache, seeds = call(2, 4, 5)
    with torch.inference_mode():
        expected = hift(mel, cache, generators=generators(seeds))
        for runner in (HiFTRunner(hift, graphs=False), HiFTRunner(hift, graphs=True)):  # captures: CUDA only
            got = runner(mel, cache, generators(seeds))
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
            assert runner.replays == 0 and not runner._graphs


def _checked(runner: HiFTRunner, hift: HiFTGenerator, batch: int, seed: int) -> None:
    """One call through the runner gives the model's own audio, source and noise draws."""
    mel, cache, seeds = call(batch, 7, seed, cached=960)
    through, direct = generators(seeds), generators(seeds)
    speech, source = runner(mel, cache, through)
    expected_speech, expected_source = hift(mel, cache, generators=direct)
    torch.testing.assert_close(speech, expected_speech, rtol=0, atol=1e-6)
    torch.testing.assert_close(source, expected_source, rtol=0, atol=1e-6)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(through, direct, strict=True))


def test_deferred_shapes_wait_for_the_capture_thread_and_run_eagerly_meanwhile():
    """With defer the call that makes a shape due keeps its inputs and runs eagerly; the shape is
    captured by capture_missed (the capture thread's call), after which calls replay."""
    hift = tiny_hift()
    runner = HiFTRunner(hift, graphs=True, capture=False, defer=True)
    with torch.inference_mode():
        _checked(runner, hift, 4, 1)
        assert runner.missed == 0 and not runner.capture_missed()
        _checked(runner, hift, 4, 2)  # due: kept for the capture thread, run eagerly
        _checked(runner, hift, 3, 3)  # still waiting: eager again, not kept twice
        assert runner.missed == 1 and runner.replays == 0 and not runner._graphs
        assert runner.capture_missed() and runner.missed == 0 and len(runner._graphs) == 1
        assert not runner.capture_missed()
        _checked(runner, hift, 3, 4)  # replays (a padded eager call on a CPU) with its own values
    assert runner.replays == 1


def test_the_capture_thread_captures_what_its_sources_missed():
    hift = tiny_hift()
    runner = HiFTRunner(hift, graphs=True, capture=False, defer=True)
    thread = CaptureThread([runner], contextlib.nullcontext)
    thread.start()
    try:
        with torch.inference_mode():
            for seed in (1, 2):
                _checked(runner, hift, 2, seed)
        deadline = time.monotonic() + 30
        while thread.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.pending == 0 and len(runner._graphs) == 1
        with torch.inference_mode():
            _checked(runner, hift, 2, 3)
        assert runner.replays == 1
    finally:
        thread.stop()
    assert thread._thread is None
    empty = CaptureThread([], contextlib.nullcontext)
    empty.start()  # no sources: no thread
    assert empty._thread is None and empty.pending == 0
