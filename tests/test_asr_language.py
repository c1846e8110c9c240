"""The language a recogniser heard picks the rules a saved voice's transcript is normalised by."""

import pytest

from cosyapp.frontend.features import VoiceFeatures
from cosyapp.frontend.text import TextFrontend
from cosyapp.frontend.voices import Voice, VoiceInfo
from cosyapp.models.checkpoint import BACKBONE_DIR


@pytest.fixture(scope="module")
def text(tiny_model_dir):
    return TextFrontend(tiny_model_dir / BACKBONE_DIR)


@pytest.mark.parametrize("transcript", ["사과 3개 주세요", "りんごを3個ください"])
def test_japanese_and_korean_transcripts_stay_as_written(text, transcript):
    language = "ko" if "개" in transcript else "ja"
    assert text.normalize_prompt(f"  {transcript}\x07 ", language) == transcript
    assert "3" not in text.normalize_prompt(transcript)  # by script alone, rules of another language


def test_an_english_transcript_gets_the_english_rules_whatever_its_script(text):
    assert text.normalize_prompt("Order 3 of 中", "en") == text._normalize_en("Order 3 of 中")
    assert text.normalize_prompt("Order 3 of 中") == text._normalize_zh("Order 3 of 中")


def test_cantonese_gets_the_chinese_rules(text):
    assert text.normalize_prompt("我哋有3個", "yue") == text.normalize_prompt("我哋有3個") != "我哋有3個"


def test_a_voice_normalises_its_transcript_in_its_language(text):
    import torch

    features = VoiceFeatures(torch.zeros(10, dtype=torch.long), torch.zeros(20, 80), torch.zeros(192))
    info = VoiceInfo(id="user-000000000000", name="ko", kind="user", language="ko")
    inputs = Voice(info, features, prompt_text="사과 3개 주세요").prompt(text)
    assert inputs.text_ids.tolist() == text.tokenize("사과 3개 주세요")
