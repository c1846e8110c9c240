"""The demo (tiny random-weight) model stops at about a spoken pace: some 3 speech tokens per text
token, varying from draw to draw, through upstream's sampling and EOS rules (modelgen/pace.py).

Measured on the reference decoding loop (``Qwen2LM.generate``), whose sampling every engine shares.
"""

import statistics

import pytest
import torch

from cosyapp.frontend.text import TextFrontend
from cosyapp.frontend.voice import VoiceFrontend
from cosyapp.frontend.voices import VoiceLibrary
from cosyapp.models.checkpoint import BACKBONE_DIR

SENTENCES = {
    "en-espeak-us": [
        "The quick brown fox jumps over the lazy dog.",
        "On March 3rd, Dr. Smith paid $42.50 for 3 books at the fair, about 20% off.",
        "Please call me back when you get this message, I will be at home all evening.",
    ],
    "zh-aishell-w0121": [
        "今天天气很好，我们一起去公园散步吧。",
        "收到朋友从远方寄来的生日礼物，那份意外的惊喜让我心中充满了甜蜜的快乐。",
        "2024年3月5日，我花了42.5元买了3本书。",
    ],
}
DRAWS = 2


@pytest.fixture(scope="module")
def ratios(tiny_model_dir, tiny_model, tmp_path_factory):
    """{(voice, sentence, draw): speech tokens / text tokens} on the tiny model."""
    text = TextFrontend(tiny_model_dir / BACKBONE_DIR)
    voices = VoiceLibrary(tmp_path_factory.mktemp("voices"), VoiceFrontend(tiny_model_dir))
    lm = tiny_model.lm
    found = {}
    for voice_id, sentences in SENTENCES.items():
        prompt = voices.get(voice_id).prompt(text)
        for i, sentence in enumerate(sentences):
            ids = torch.tensor(text.prepare(sentence)[0].ids)
            for draw in range(DRAWS):
                generator = torch.Generator().manual_seed(draw)
                tokens = list(lm.generate(prompt.text_ids, ids, prompt.speech_tokens, generator))
                found[voice_id, i, draw] = len(tokens) / len(ids)
    return found


def test_mean_speech_tokens_per_text_token_is_a_spoken_pace(ratios):
    assert 2.0 <= statistics.mean(ratios.values()) <= 4.0


def test_no_sentence_runs_to_the_length_limit(tiny_model, ratios):
    assert max(ratios.values()) < tiny_model.lm.sampling.max_token_text_ratio / 2


def test_lengths_vary_between_draws_of_the_same_sentence(ratios):
    pairs = {key[:2] for key in ratios}
    differing = [p for p in pairs if len({ratios[(*p, d)] for d in range(DRAWS)}) > 1]
    assert len(differing) >= len(pairs) / 2
