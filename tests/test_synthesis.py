import pytest
import torch

from cosyapp.models.cosyvoice2 import PromptInputs


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(5)
    return PromptInputs(
        text_ids=torch.tensor([11, 12, 13, 14]),
        speech_tokens=torch.randint(0, 6561, (12,), generator=g),
        speech_feat=torch.randn(24, 80, generator=g) - 5.0,
        embedding=torch.randn(192, generator=g),
    )


TEXT = torch.tensor([20, 21, 22, 23, 24])


def synth(model, prompt, seed=0, speed=1.0):
    torch.manual_seed(seed)
    return model.synthesize(TEXT, prompt, speed=speed, generator=torch.Generator().manual_seed(seed))


def test_two_mel_frames_per_token_and_480_samples_per_frame(tiny_model, prompt):
    tokens = torch.randint(0, 6561, (17,))
    mel = tiny_model.tokens_to_mel(tokens, prompt)
    assert mel.shape == (80, 34)
    assert tiny_model.mel_to_wave(mel).shape == (34 * 480,)


def test_synthesis_length_follows_the_generated_tokens(tiny_model, prompt):
    tokens = list(
        tiny_model.lm.generate(prompt.text_ids, TEXT, prompt.speech_tokens, torch.Generator().manual_seed(0))
    )
    wave = synth(tiny_model, prompt, seed=0)
    assert len(tokens) >= 10
    assert wave.shape == (len(tokens) * 2 * 480,)
    assert wave.abs().max() <= 0.99 and wave.abs().max() > 0


def test_same_seeds_give_identical_audio(tiny_model, prompt):
    assert torch.equal(synth(tiny_model, prompt, seed=3), synth(tiny_model, prompt, seed=3))


def test_speed_shortens_the_mel_before_the_vocoder(tiny_model, prompt):
    mel = tiny_model.tokens_to_mel(torch.randint(0, 6561, (20,)), prompt)
    assert tiny_model.mel_to_wave(mel, speed=2.0).shape == (20 * 480,)
    assert tiny_model.mel_to_wave(mel, speed=0.8).shape == (50 * 480,)
