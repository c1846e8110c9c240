"""Bad text at the text frontend: each class gets a TextError naming the problem, or a defined result.

The same classes through the HTTP API are in test_input_api.py; through the UI in
tests/ui/test_ui_hardening.py. docs/hardening.md lists them all.
"""

import pytest

from cosyapp.frontend.split import MAX_PIECE_LEN, MAX_SENTENCE_LEN, cut_long_pieces
from cosyapp.frontend.text import TextError, TextFrontend, unsupported_script
from cosyapp.models.checkpoint import BACKBONE_DIR


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """No wetext (the texts here have no digits, which is all wetext would change)."""
    return TextFrontend(tiny_model_dir / BACKBONE_DIR, normalize=False)


@pytest.mark.parametrize("text", ["", "   ", "\n\t \r\n", "\x00\x07\x1b", " \x7f\x85 "])
def test_empty_whitespace_or_control_only_text_is_empty(plain, text):
    with pytest.raises(TextError, match="The text is empty: type what the voice should say"):
        plain.prepare(text)


@pytest.mark.parametrize("text", ["!!! ???", "… — …", "🎉👍🏽", "❤️", "\u200d\u200b", "<> & ^^ $$"])
def test_punctuation_symbols_or_emoji_only_have_nothing_to_read(plain, text):
    with pytest.raises(TextError, match="nothing to read aloud: it has no letters or digits"):
        plain.prepare(text)


def test_control_characters_and_lone_surrogates_are_removed_before_splitting(plain):
    clean = plain.prepare("Hello there.\nHow are you?")
    dirty = plain.prepare("Hel\x00lo\x1b there.\r\nHow\x7f are\ud800 you?\x9f")
    assert dirty == clean


def test_emoji_inside_text_stay_with_the_words(plain):
    assert [s.text for s in plain.prepare("Hello 🎉 world")] == ["Hello 🎉 world."]


def test_a_long_run_of_emoji_is_cut_and_its_parts_without_words_are_dropped(plain):
    sentences = plain.prepare("Hello there, my friend. " + "🎉 " * 150 + "!")
    assert len(sentences) == 1 and sentences[0].text.startswith("Hello there, my friend. 🎉")
    assert sentences[0].text.count("🎉") < 150 and len(sentences[0].ids) <= MAX_SENTENCE_LEN


@pytest.mark.parametrize(
    "text, script",
    [
        ("Привет, как дела?", "Cyrillic"),
        ("مرحبا بالعالم", "Arabic"),
        ("नमस्ते", "Devanagari"),
        ("สวัสดี", "Thai"),
    ],
)
def test_text_only_in_an_unsupported_script_is_refused_naming_the_script(plain, text, script):
    with pytest.raises(TextError, match=rf"script this model cannot read \({script}\)"):
        plain.prepare(text)


@pytest.mark.parametrize(
    "text", ["Hello", "こんにちは", "カタカナ", "안녕하세요", "你好", "12345", "Привет, Anna"]
)
def test_supported_scripts_digits_and_mixed_text_are_accepted(plain, text):
    assert unsupported_script(text) is None
    assert plain.prepare(text)


def test_one_huge_english_sentence_without_punctuation_is_cut_within_the_lm_limit(plain):
    text = " ".join(f"word{chr(97 + i % 26)}" for i in range(800))  # ~4,800 characters, no mark
    sentences = plain.prepare(text)
    lengths = [len(s.ids) for s in sentences]
    assert len(sentences) > 10 and max(lengths) <= MAX_SENTENCE_LEN
    assert "".join(s.text for s in sentences) == text + "."


def test_one_huge_chinese_sentence_without_punctuation_is_cut_within_the_lm_limit(plain):
    text = "天气很好" * 1200  # 4,800 characters, no mark
    sentences = plain.prepare(text)
    assert len(sentences) > 10 and max(len(s.text) for s in sentences) <= MAX_SENTENCE_LEN
    assert "".join(s.text for s in sentences) == text + "。"


def test_one_huge_word_is_cut_between_characters(plain):
    sentences = plain.prepare("a" * 5000)
    assert max(len(s.ids) for s in sentences) <= MAX_SENTENCE_LEN
    assert "".join(s.text for s in sentences) == "a" * 5000 + "."


def test_cutting_prefers_spaces_and_commas_and_keeps_every_character():
    parts = cut_long_pieces(["aa bb,cc dd ee"], 6, len)
    assert parts == ["aa bb,", "cc dd ", "ee"]
    assert cut_long_pieces(["abcdefghij"], 4, len) == ["ab", "cdef", "ghij"]


def test_pieces_within_the_cap_are_left_as_upstream_makes_them():
    piece = "x" * MAX_PIECE_LEN
    assert cut_long_pieces([piece, "y."], MAX_PIECE_LEN, len) == [piece, "y."]


def test_text_over_the_limit_is_refused_before_any_work(tiny_model_dir):
    frontend = TextFrontend(tiny_model_dir / BACKBONE_DIR, max_chars=50, normalize=False)
    with pytest.raises(TextError, match="The text is 51 characters long; the limit is 50"):
        frontend.prepare("a" * 51)
