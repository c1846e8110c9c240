"""Fine-grained tags ([laughter], <strong>…</strong>, ...) reach the tokenizer whole through wetext
normalisation and sentence splitting, in Chinese, English and mixed text; anything else in brackets
is spoken as written."""

import pytest

from cosyapp.frontend.split import MAX_PIECE_LEN, cut_long_pieces
from cosyapp.frontend.tags import ENDOFPROMPT, TAGS, outside_tags, split_at_tags
from cosyapp.frontend.text import ADDITIONAL_SPECIAL_TOKENS, TextFrontend


@pytest.fixture(scope="module")
def text(tiny_model_dir):
    return TextFrontend(tiny_model_dir / "CosyVoice-BlankEN")


def tag_ids(text, sentences):
    special = {text.tokenizer.convert_tokens_to_ids(tag): tag for tag in TAGS}
    return [special[i] for s in sentences for i in s.ids if i in special]


def test_the_tags_are_upstreams_special_tokens_after_endofprompt_in_order():
    assert ADDITIONAL_SPECIAL_TOKENS[2:] == (ENDOFPROMPT, *TAGS) and len(TAGS) == 16


@pytest.mark.parametrize("tag", TAGS)
def test_a_tag_beside_digits_survives_english_normalisation_and_the_digits_are_read(text, tag):
    # wetext alone fails on such text (its English tagger has no path through "3[sigh]"), and the
    # whole text used to go through unnormalised.
    sentences = text.prepare(f"It costs $3{tag} today, and {tag}25 people came.")
    joined = " ".join(s.text for s in sentences)
    assert joined.count(tag) == 2 and "three dollars" in joined and "twenty five" in joined
    assert tag_ids(text, sentences) == [tag, tag]


@pytest.mark.parametrize("tag", TAGS)
def test_a_tag_beside_digits_survives_chinese_normalisation(text, tag):
    sentences = text.prepare(f"我有3{tag}只猫，还有25只狗{tag}。")
    joined = "".join(s.text for s in sentences)
    assert joined == f"我有三{tag}只猫，还有二十五只狗{tag}。"
    assert tag_ids(text, sentences) == [tag, tag]


def test_spaces_around_a_tag_stay_in_english(text):
    [sentence] = text.prepare("I have 3 [laughter] cats and 25 dogs.")
    assert sentence.text == "I have three [laughter] cats and twenty five dogs."


def test_tags_in_mixed_text_survive_splitting_into_sentences(text):
    source = (
        "今天天气很好[laughter]，我们去公园吧。在他讲述那个荒诞故事的过程中，他突然[laughter]停下来，"
        "因为他自己也被逗笑了[laughter]。Let's go <strong>right now</strong> [breath] with 2 friends!"
    )
    sentences = text.prepare(source)
    assert len(sentences) >= 2
    assert tag_ids(text, sentences) == ["[laughter]"] * 3 + ["<strong>", "</strong>", "[breath]"]


def test_a_long_run_without_marks_is_never_cut_inside_a_tag(text):
    # 188 characters with no comma: cut between characters, at 94, inside the tag (90-107).
    source = "好" * 90 + "[vocalized-noise]" + "好" * 80 + "。"
    sentences = text.prepare(source)
    assert len(sentences) == 2
    assert tag_ids(text, sentences) == ["[vocalized-noise]"]
    assert "".join(s.text for s in sentences) == source


def test_cut_positions_move_out_of_tags():
    word = "ab[laughter]cd"
    assert [outside_tags(word, n) for n in (1, 2, 5, 12, 13)] == [1, 2, 2, 12, 13]
    assert outside_tags("[sigh]xyz", 3) == len("[sigh]")  # a cut at 0 would make no progress
    # Halving from 24 characters would cut at 12, inside the tag (6-14); the cut moves to 6.
    assert cut_long_pieces(["x" * 6 + "[breath]" + "y" * 10], 12, len) == ["x" * 6, "[breath]y", "y" * 9]
    assert max(map(len, TAGS)) < MAX_PIECE_LEN


def test_split_at_tags_alternates_text_and_tags():
    assert split_at_tags("a[sigh]<strong>b</strong>") == ["a", "[sigh]", "", "<strong>", "b", "</strong>", ""]


@pytest.mark.parametrize("malformed", ["[laugh]", "[Laughter]", "[laughter", "<strong", "< strong>"])
def test_a_malformed_tag_is_spoken_as_text_not_dropped(text, malformed):
    sentences = text.prepare(f"Well {malformed} that was funny.")
    assert malformed in sentences[0].text
    assert tag_ids(text, sentences) == [] and len(text.tokenize(malformed)) > 1
