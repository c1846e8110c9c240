"""Text frontend: upstream's normalisation rules, sentence splitting and Qwen2 tokenizer setup
(docs/model.md §3.1, §3.2).

Expected normalisations were checked against wetext 0.1.8's output before the Python rules of
docs/model.md §3.1.
The tiny model's tokenizer is a small byte-level BPE, not Qwen2's, so English lengths are measured
with it.
"""

import dataclasses
import logging

import pytest
from transformers import AutoTokenizer

from cosyapp.frontend.split import EN_MARKS, ZH_MARKS, cut_at_marks, merge_pieces, split_paragraph
from cosyapp.frontend.text import (
    ADDITIONAL_SPECIAL_TOKENS,
    Sentence,
    TextError,
    TextFrontend,
    log_short_sentences,
)
from cosyapp.models.checkpoint import BACKBONE_DIR

NEW_SPECIAL_TOKENS = ADDITIONAL_SPECIAL_TOKENS[2:]  # <|im_start|> and <|im_end|> are already in Qwen2


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_model_dir):
    return tiny_model_dir / BACKBONE_DIR


@pytest.fixture(scope="module")
def frontend(tokenizer_dir):
    return TextFrontend(tokenizer_dir)


@pytest.fixture(scope="module")
def plain(tokenizer_dir):
    """No wetext: only the Python rules of docs/model.md §3.1 and the splitting."""
    return TextFrontend(tokenizer_dir, normalize=False)


def _zh(n: int, char: str = "字") -> str:
    """A Chinese piece of exactly ``n`` characters, ending with a full stop."""
    return char * (n - 1) + "。"


# --- tokenizer -------------------------------------------------------------------------------------


def test_the_17_new_special_tokens_get_consecutive_ids_after_the_base_vocabulary(frontend, tokenizer_dir):
    base = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    assert len(NEW_SPECIAL_TOKENS) == 17
    assert frontend.tokenizer.convert_tokens_to_ids(list(NEW_SPECIAL_TOKENS)) == list(range(base, base + 17))
    assert len(frontend.tokenizer) == base + 17


def test_im_start_and_im_end_keep_their_base_ids(frontend, tokenizer_dir):
    base = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = ["<|im_start|>", "<|im_end|>"]
    assert frontend.tokenizer.convert_tokens_to_ids(tokens) == base.convert_tokens_to_ids(tokens)


def test_eos_and_pad_are_endoftext(frontend):
    assert frontend.tokenizer.eos_token == "<|endoftext|>"
    assert frontend.tokenizer.pad_token == "<|endoftext|>"


def test_special_tokens_encode_as_single_ids_inside_text(frontend):
    ids = frontend.tokenize("hi<|endofprompt|>you [laughter]!")
    endofprompt, laughter = frontend.tokenizer.convert_tokens_to_ids(["<|endofprompt|>", "[laughter]"])
    assert ids.count(endofprompt) == 1
    assert ids.count(laughter) == 1
    assert frontend.tokenize("[laughter]") == [laughter]


def test_tokenize_adds_no_bos_or_eos(frontend):
    assert frontend.tokenize("") == []
    assert frontend.tokenize("<|endofprompt|>") == frontend.tokenizer.convert_tokens_to_ids(
        ["<|endofprompt|>"]
    )


# --- Chinese normalisation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2024年3月5日", "二零二四年三月五日"),
        ("今天是2024年3月5日，气温25.5°C", "今天是二零二四年三月五日，气温二十五点五摄氏度"),
        ("他跑了100米，用时9.58秒。", "他跑了一百米，用时九点五八秒。"),
        ("价格：$100", "价格：一百美元"),
        ("这是50%的概率", "这是百分之五十的概率"),
        ("面积10m²", "面积十平方米"),
        # wetext reads "我用 iPhone 十五 Pro 拍照"; then the blanks next to CJK characters go.
        ("我用 iPhone 15 Pro 拍照", "我用iPhone十五Pro拍照"),
        # wetext reads "v一点二版本，，"; the trailing comma run becomes a full stop.
        ("v1.2 版本，，", "v一点二版本。"),
    ],
)
def test_chinese_text_is_read_by_wetext_then_the_python_rules(frontend, text, expected):
    assert frontend.normalize_prompt(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("你好\n世界", "你好世界"),
        ("你好 世界 hello world 好", "你好世界hello world好"),
        ("面积m²，体积m³", "面积m平方，体积m立方"),
        ("v1.2版本", "v1。2版本"),
        ("我喜欢 A - B 测试", "我喜欢A，B测试"),
        ("（注意）这是【重点】——`真的`", "注意这是重点 真的"),
        ("好的，,、", "好的。"),
    ],
    ids=["newline", "blanks", "corner-marks", "dot", "spaced-hyphen", "brackets-and-dash", "trailing-commas"],
)
def test_chinese_rules_apply_without_wetext(plain, text, expected):
    assert plain.normalize_prompt(text) == expected


def test_wetext_quotes_come_back_unescaped_in_chinese(frontend):
    assert frontend.normalize_prompt('他说"好3个"') == '他说"好三个"'


# --- English normalisation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I have 3 apples.", "I have three apples."),
        ("Pi is 3.5", "Pi is three point five"),
        ("It costs $3.50.", "It costs three point five dollars."),  # wetext's own reading of cents
        ("On March 5, 2024 we met.", "On the fifth of march, twenty twenty four we met."),
        ("Today is 2024-03-05.", "Today is the fifth of march twenty twenty four."),
        ("123", "one hundred and twenty three"),  # English, although wetext's "auto" would read it in Chinese
    ],
)
def test_english_text_is_read_by_wetext(frontend, text, expected):
    assert frontend.normalize_prompt(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I have 3 apples.", "I have three apples."),
        ("Pi is 3.5", "Pi is three.five"),
        ("123", "one hundred and twenty-three"),
    ],
)
def test_english_digit_runs_are_spelled_out_by_inflect_without_wetext(plain, text, expected):
    assert plain.normalize_prompt(text) == expected


def test_english_text_without_digits_is_left_to_the_python_rules(frontend):
    # wetext 0.0.4 (upstream's pin) only normalised text with digits; 0.1 would say "doctor".
    assert frontend.normalize_prompt("Dr. Smith is here") == "Dr. Smith is here"


def test_wetext_quotes_and_backslashes_come_back_unescaped_in_english(frontend):
    assert frontend.normalize_prompt('He said "hi 3" \\ ok') == 'He said "hi three" \\ ok'


def test_text_wetext_cannot_tag_is_used_as_written_with_a_warning(frontend, caplog):
    with caplog.at_level(logging.WARNING, logger="cosyapp.frontend.text"):
        assert frontend.normalize_prompt("Call #3 now.") == "Call #three now."
    assert "wetext cannot normalise 'Call #3 now.'" in caplog.text


def test_a_number_too_long_to_spell_is_a_text_error(plain):
    with pytest.raises(TextError, match="The number 111111111111... has 40 digits, too many to read aloud"):
        plain.prepare("1" * 40)


# --- bypass and prompt -----------------------------------------------------------------------------


def test_text_with_special_markup_is_passed_through_untouched(frontend):
    text = "  I have 3 apples.<|endofprompt|> 2024年 "
    assert frontend.split(text) == [text]
    assert frontend.normalize_prompt(text) == text


def test_prompt_text_is_normalised_but_not_split_or_terminated(frontend):
    text = "  第一句。第二句有3个字  "
    assert frontend.normalize_prompt(text) == "第一句。第二句有三个字"


def test_prompt_ids_are_the_tokens_of_the_normalised_prompt(frontend):
    text = "我有3个苹果"
    assert frontend.prompt_ids(text) == frontend.tokenize("我有三个苹果")


# --- splitting -------------------------------------------------------------------------------------


def test_a_final_mark_is_appended_when_missing(plain):
    assert plain.split("你好") == ["你好。"]
    assert plain.split("hello") == ["hello."]


def test_chinese_closing_quote_stays_with_its_sentence():
    assert cut_at_marks("他说：“好！”然后走了。", ZH_MARKS) == ["他说：", "“好！”", "然后走了。"]


def test_english_closing_quote_stays_with_its_sentence():
    assert cut_at_marks('She said "Stop." Then left.', EN_MARKS) == ['She said "Stop."', " Then left."]


def test_a_quote_after_an_empty_piece_still_goes_onto_the_previous_piece():
    # The "?" has no text before it, so it is dropped; the quote after it joins "Go!".
    assert cut_at_marks('"Go!?" he said.', EN_MARKS) == ['"Go!"', " he said."]


def test_repeated_marks_keep_only_the_first(plain):
    assert plain.split("Wait!!! Go.") == ["Wait! Go."]


def test_pieces_merge_until_the_buffer_is_over_60_and_the_next_would_pass_80(plain):
    a, b, c = _zh(31, "一"), _zh(31, "二"), _zh(31, "三")
    assert plain.split(a + b + c) == [a + b, c]


def test_a_buffer_of_60_or_less_keeps_growing_past_80(plain):
    a, b, c = _zh(50, "一"), _zh(50, "二"), _zh(50, "三")
    assert plain.split(a + b + c) == [a + b, c]


def test_a_tail_shorter_than_20_is_glued_to_the_last_sentence(plain):
    a, b, tail = _zh(41, "一"), _zh(30, "二"), _zh(19, "尾")
    assert plain.split(a + b + tail) == [a + b + tail]


def test_a_tail_of_20_stands_alone(plain):
    a, b, tail = _zh(41, "一"), _zh(30, "二"), _zh(20, "尾")
    assert plain.split(a + b + tail) == [a + b, tail]


def test_english_length_is_counted_in_tokens_not_characters(plain):
    text = "[laughter] yes." * 8  # 120 characters, 5 tokens each with the tiny tokenizer
    assert len(plain.tokenize(text)) <= 60
    assert len(merge_pieces(cut_at_marks(text, EN_MARKS), len)) == 2  # what a character count would do
    assert plain.split(text) == [text]


def test_english_sentences_close_only_past_60_tokens_when_the_next_piece_passes_80(plain):
    text = "She sells sea shells by the sea shore. The quick brown fox jumps over the lazy dog! " * 6
    sentences = plain.split(text)
    assert len(sentences) >= 3
    assert "".join(sentences) == text.strip()
    for sentence, following in zip(sentences, sentences[1:], strict=False):
        next_piece = cut_at_marks(following, EN_MARKS)[0]
        assert len(plain.tokenize(sentence)) > 60
        assert len(plain.tokenize(sentence + next_piece)) > 80


def test_pieces_of_only_punctuation_are_dropped(plain):
    assert split_paragraph("……", EN_MARKS, ".", len) == ["……."]
    assert plain.split("……") == []


def test_whitespace_only_text_splits_into_nothing(plain):
    assert plain.split("   ") == []


# --- prepare ---------------------------------------------------------------------------------------


def test_prepare_returns_each_sentence_with_its_token_ids(frontend):
    text = _zh(41, "一") + _zh(30, "二") + "今天是2024年3月5日，气温25.5°C"
    sentences = frontend.prepare(text)
    assert [s.text for s in sentences] == [
        _zh(41, "一") + _zh(30, "二"),
        "今天是二零二四年三月五日，气温二十五点五摄氏度。",
    ]
    assert all(s.ids == tuple(frontend.tokenize(s.text)) for s in sentences)


def test_sentences_are_frozen(frontend):
    sentence = frontend.prepare("你好")[0]
    assert sentence == Sentence("你好。", tuple(frontend.tokenize("你好。")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sentence.text = "x"


@pytest.mark.parametrize("text", ["", "  \n\t "])
def test_empty_text_is_a_text_error(frontend, text):
    with pytest.raises(TextError, match="The text is empty"):
        frontend.prepare(text)


def test_text_longer_than_the_limit_is_a_text_error_saying_both_lengths(tokenizer_dir):
    short = TextFrontend(tokenizer_dir, max_chars=10)
    assert short.prepare("a" * 10)[0].text == "a" * 10 + "."
    with pytest.raises(TextError, match="The text is 11 characters long; the limit is 10"):
        short.prepare("a" * 11)


def test_text_with_nothing_to_read_aloud_is_a_text_error(frontend):
    with pytest.raises(TextError, match="nothing to read aloud"):
        frontend.prepare("!!!")


def test_text_error_is_a_value_error():
    assert issubclass(TextError, ValueError)


def test_sentences_much_shorter_than_the_prompt_are_logged(caplog):
    sentences = [Sentence("短句。", (1, 2)), Sentence("不短的一句。", (3, 4))]
    with caplog.at_level(logging.WARNING, logger="cosyapp.frontend.text"):
        short = log_short_sentences(sentences, normalized_prompt="提示" * 5)
    assert short == sentences[:1]
    assert "'短句。' is much shorter than the prompt text" in caplog.text


def test_token_ids_of_a_few_strings_are_the_byte_level_bpe_pieces(tiny_model_dir):
    # The tiny tokenizer's vocabulary is ours (trained on a fixed corpus), so the ids are checked
    # against its own piece table rather than Qwen2's.
    frontend = TextFrontend(tiny_model_dir / "CosyVoice-BlankEN")
    pieces = frontend.tokenizer.convert_tokens_to_ids
    assert frontend.tokenize("Hello") == pieces(["Hell", "o"])
    assert frontend.tokenize(" the quick") == pieces(["Ġthe", "Ġ", "qu", "ic", "k"])
    assert frontend.tokenize("你好") == pieces(["ä½", "ł", "å¥½"])  # UTF-8 bytes as byte-level symbols
    base = len(frontend.tokenizer) - 17
    assert frontend.tokenize("Hello<|endofprompt|>[breath]") == pieces(["Hell", "o"]) + [base, base + 1]
