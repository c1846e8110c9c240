"""From text and a real recording to a waveform on the tiny model, through every frontend stage."""

import pytest
import torch

from cosyapp.bench.reference import ReferenceSynthesizer
from cosyapp.frontend.text import TextError, TextFrontend
from cosyapp.frontend.voice import VoiceFrontend
from cosyapp.frontend.voices import VoiceLibrary


@pytest.fixture(scope="module")
def synthesizer(tiny_model):
    return ReferenceSynthesizer(tiny_model, TextFrontend(tiny_model.model_dir / "CosyVoice-BlankEN"))


@pytest.fixture(scope="module")
def voice(tiny_model, tmp_path_factory):
    library = VoiceLibrary(tmp_path_factory.mktemp("voices"), VoiceFrontend(tiny_model.model_dir))
    return library.get("zh-aishell-w0121")


def expected_tokens(synthesizer, voice, text, seed):
    """Token count of each sentence when decoding with the seed the synthesizer uses."""
    prompt = voice.prompt(synthesizer.text)
    generator = torch.Generator().manual_seed(seed)
    counts = []
    for sentence in synthesizer.text.prepare(text):
        ids = torch.tensor(sentence.ids)
        counts.append(
            len(list(synthesizer.model.lm.generate(prompt.text_ids, ids, prompt.speech_tokens, generator)))
        )
    return counts


def test_text_and_real_recording_give_960_samples_per_speech_token(synthesizer, voice):
    text = "Hello there. This is a test of the tiny model!"
    rate, wave = synthesizer.synthesize(text, voice, seed=7)
    counts = expected_tokens(synthesizer, voice, text, seed=7)
    assert rate == 24000 and len(counts) == 1
    assert wave.dtype.name == "float32" and len(wave) == 960 * sum(counts) > 0
    assert abs(wave).max() <= 0.99


def test_each_sentence_is_synthesised_and_concatenated(synthesizer, voice):
    text = "我们一起去公园散步吧。" * 10
    assert len(synthesizer.text.prepare(text)) == 2
    _, wave = synthesizer.synthesize(text, voice, seed=3)
    assert len(wave) == 960 * sum(expected_tokens(synthesizer, voice, text, seed=3))


def test_same_seed_gives_the_same_samples(synthesizer, voice):
    _, a = synthesizer.synthesize("Same seed, same audio.", voice, seed=11)
    _, b = synthesizer.synthesize("Same seed, same audio.", voice, seed=11)
    _, c = synthesizer.synthesize("Same seed, same audio.", voice, seed=12)
    assert (a == b).all()
    assert len(a) != len(c) or not (a == c).all()


def test_speed_changes_the_duration(synthesizer, voice):
    _, normal = synthesizer.synthesize("Speed it up.", voice, seed=5)
    _, fast = synthesizer.synthesize("Speed it up.", voice, speed=2.0, seed=5)
    assert len(fast) == 480 * int(len(normal) // 480 / 2.0)


def test_unusable_text_is_a_text_error(synthesizer, voice):
    with pytest.raises(TextError):
        synthesizer.synthesize("   ", voice)
