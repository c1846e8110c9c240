"""Text to model input: normalise (wetext), split into sentences, encode with the Qwen2 tokenizer.

Mirrors upstream CosyVoice2's wetext frontend (``text_normalize``, ``split_paragraph``) and its
``QwenTokenizer``; see docs/model.md §3.1 and §3.2. The TTS text is split into sentences,
each synthesised on its own; the prompt text is normalised but never split.

wetext, inflect and regex are imported inside the functions that use them, so this module imports on
a bare GPU box.
"""

import copy
import itertools
import logging
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cosyapp.errors import TextError as TextError  # raised here, caught at the edges
from cosyapp.frontend.split import EN_MARKS, ZH_MARKS, cut_blocks, split_paragraph
from cosyapp.frontend.tags import ENDOFPROMPT, TAGS, split_at_tags
from cosyapp.options import DEFAULTS

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# Upstream's order; the first two already exist in Qwen2, the other 17 get consecutive new ids.
ADDITIONAL_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", ENDOFPROMPT, *TAGS)


_CJK = re.compile(r"[\u4e00-\u9fff]")
_DIGIT = re.compile(r"\d")
_WETEXT_ESCAPED = re.compile(r'\\(["\\])')
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
# C0/C1 control characters except tab and newline, and lone surrogates (JSON can carry them, but
# they cannot be encoded for the tokenizer).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
# Scripts of the languages CosyVoice 2 was trained on (Chinese, English, Japanese, Korean).
_SUPPORTED_LETTER = r"[\p{Latin}\p{Han}\p{Hiragana}\p{Katakana}\p{Hangul}]"


def check_text(text: str, max_chars: int) -> None:
    """Raise ``TextError`` if ``text`` is empty (or only whitespace and control characters), longer
    than ``max_chars``, has nothing to read aloud (no letter or digit: only punctuation, symbols or
    emoji), or has letters only in scripts the model was not trained on. Cheap: no normalisation."""
    if not remove_control_characters(text).strip():
        raise TextError("The text is empty: type what the voice should say.")
    if len(text) > max_chars:
        raise TextError(
            f"The text is {len(text):,} characters long; the limit is {max_chars:,}. "
            "Shorten it or send it in parts."
        )
    if has_nothing_to_read(text):
        raise TextError(
            "The text has nothing to read aloud: it has no letters or digits, only punctuation, "
            "symbols or emoji."
        )
    if (script := unsupported_script(text)) is not None:
        raise TextError(
            f"The text is written in a script this model cannot read ({script}). CosyVoice 2 reads "
            "Chinese, English, Japanese and Korean."
        )


NOTHING_TO_READ = "The text has nothing to read aloud once normalised."


@dataclass(frozen=True)
class Sentence:
    """One sentence to synthesise on its own: normalised text and its token ids."""

    text: str
    ids: tuple[int, ...]


class TextFrontend:
    """Normalises, splits and tokenises text exactly as upstream's wetext frontend does.

    Args:
        tokenizer_dir: the model's ``CosyVoice-BlankEN/`` folder (Qwen2 tokenizer files).
        max_chars: longest text ``prepare`` accepts, in characters.
        normalize: run wetext; when False the punctuation rules, number spelling and splitting still
            run, as upstream does when no normalizer is installed.
    """

    def __init__(self, tokenizer_dir: Path, max_chars: int = DEFAULTS.max_text_chars, normalize: bool = True):
        import inflect
        from transformers import AutoTokenizer

        assert max_chars > 0, max_chars
        self.max_chars = max_chars
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.tokenizer.add_special_tokens(
            {
                "eos_token": EOS_TOKEN,
                "pad_token": EOS_TOKEN,
                "additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS),
            }
        )
        self._inflect = inflect.engine()
        self._zh_normalizer, self._en_normalizer = wetext_normalizers() if normalize else (None, None)

    def with_normalizers(self, zh, en) -> "TextFrontend":
        """A copy (same tokenizer and limits) that calls ``zh.normalize`` / ``en.normalize`` where this
        one calls wetext's normalizers, e.g. wetext in another process; none if normalisation is off.
        The copy has its own number speller (inflect keeps per-call state), so it may run in another
        thread than this one."""
        import inflect

        other = copy.copy(self)
        other._inflect = inflect.engine()
        if self._zh_normalizer is not None:
            other._zh_normalizer, other._en_normalizer = zh, en
        return other

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``: default settings, no BOS/EOS, added special tokens matched anywhere."""
        return self.tokenizer(text)["input_ids"]

    def normalize_prompt(self, text: str, language: str = "") -> str:
        """The prompt text normalised as one string (upstream's ``split=False``); never split.

        ``language`` (a recogniser's zh, yue, en, ja or ko; "" unknown) picks the rules instead of the
        script: Japanese and Korean have none (the Chinese rules would read their digits as Chinese
        numbers, the English ones spell them out in English), so their transcript stays as written.
        """
        text = remove_control_characters(text)
        if _skips_normalization(text):
            return text
        text = text.strip()
        if language in ("ja", "ko"):
            return text
        chinese = language in ("zh", "yue") or (language != "en" and _is_chinese(text))
        return self._normalize_zh(text) if chinese else self._normalize_en(text)

    def split(self, text: str) -> list[str]:
        """The TTS text normalised and split into sentences as one piece (upstream's ``split=True``).

        Control characters are removed first; sentences with nothing to read aloud (no letter or
        digit) are dropped. Raises ``TextError`` for a number too long to spell out.
        """
        text = remove_control_characters(text)
        if _skips_normalization(text):
            return [text]
        text = text.strip()
        return self._split_normalized(text, _is_chinese(text))

    def prepare_blocks(self, text: str) -> Iterator[list[Sentence]]:
        """The sentences of the user's ``text`` with their token ids, a block at a time.

        Long texts are normalised and split block by block (``split.cut_blocks``: about 1,000
        characters, the first 300, each ending where a sentence surely ends), so a caller can start on the
        first sentences while the rest is prepared; the language is chosen once, for the whole text,
        as upstream. A block may have no sentence (nothing to read aloud). Lazy: the first ``next``
        raises ``TextError`` for text ``check_text`` refuses (with ``max_chars``), any ``next`` for
        a number too long to spell out.
        """
        check_text(text, self.max_chars)
        text = remove_control_characters(text)
        if _skips_normalization(text):
            yield [Sentence(text, tuple(self.tokenize(text)))]
            return
        text = text.strip()
        chinese = _is_chinese(text)
        for block in cut_blocks(text, chinese):
            sentences = self._split_normalized(block.strip(), chinese)
            yield [Sentence(s, tuple(self.tokenize(s))) for s in sentences]

    def prepare(self, text: str) -> list[Sentence]:
        """Every sentence of ``prepare_blocks(text)``.

        Raises ``TextError`` for text ``check_text`` refuses (with ``max_chars``), or that has
        nothing to read aloud once normalised.
        """
        sentences = [s for block in self.prepare_blocks(text) for s in block]
        if not sentences:
            raise TextError(NOTHING_TO_READ)
        return sentences

    def prompt_ids(self, prompt_text: str, language: str = "") -> list[int]:
        """Token ids of the normalised prompt text (tokenised apart from the TTS text, as upstream)."""
        return self.tokenize(self.normalize_prompt(prompt_text, language))

    def _split_normalized(self, text: str, chinese: bool) -> list[str]:
        if chinese:
            sentences = split_paragraph(self._normalize_zh(text), ZH_MARKS, "。", len)
        else:
            sentences = split_paragraph(self._normalize_en(text), EN_MARKS, ".", self._token_count)
        return [s for s in sentences if not has_nothing_to_read(s)]

    def _token_count(self, text: str) -> int:
        return len(self.tokenize(text))

    def _normalize_zh(self, text: str) -> str:
        text = remove_blanks(_run_wetext(self._zh_normalizer, text).replace("\n", ""))
        text = text.replace("²", "平方").replace("³", "立方")
        text = text.replace(".", "。").replace(" - ", "，")
        for bracket in "（）【】`":
            text = text.replace(bracket, "")
        text = text.replace("——", " ")
        return _TRAILING_COMMAS.sub("。", text)

    def _normalize_en(self, text: str) -> str:
        return self._spell_out_digits(_run_wetext(self._en_normalizer, text))

    def _spell_out_digits(self, text: str) -> str:
        """``text`` with each maximal run of ``str.isdigit`` characters in English words.

        Separators are not part of a run, so ``3.5`` becomes ``three.five``, as upstream. Raises
        ``TextError`` for a run too long for inflect (37 digits or more).
        """
        import inflect

        parts = []
        for is_digit, run in itertools.groupby(text, key=str.isdigit):
            run = "".join(run)
            if not is_digit:
                parts.append(run)
                continue
            try:
                parts.append(self._inflect.number_to_words(run))
            except inflect.NumOutOfRangeError as err:
                raise TextError(
                    f"The number {run[:12]}... has {len(run)} digits, too many to read aloud as one number; "
                    "separate its digits with spaces."
                ) from err
        return "".join(parts)


def wetext_normalizers():
    """The ("zh", "en") wetext normalizers of upstream's wetext path.

    The language is set explicitly: wetext's "auto" reads an all-digit English text such as "2024"
    in Chinese, while upstream means the zh normalizer for text with CJK characters only.
    """
    from wetext import Normalizer

    return Normalizer(lang="zh", operator="tn", remove_erhua=False), Normalizer(lang="en", operator="tn")


def _run_wetext(normalizer, text: str) -> str:
    """``text`` through a wetext normalizer (None: unchanged), behaving as upstream's wetext 0.0.4.

    wetext 0.1 runs its English FSTs on any text, where 0.0.4 left text without digits alone, and it
    returns each ``"`` and ``\\`` escaped once too often; both are undone here. When its tagger has
    no path through the text (e.g. "#3", "3²", "a \\n 3" in English) wetext fails an assertion; the
    text is then used as written, as upstream does when wetext is not installed. Not upstream:
    wetext runs on the text between fine-grained tags, never on a tag (``tags.py``).
    """
    if normalizer is None or not _DIGIT.search(text):
        return text
    parts = split_at_tags(text)
    parts[::2] = [_run_wetext_untagged(normalizer, part) for part in parts[::2]]
    return "".join(parts)


def _run_wetext_untagged(normalizer, text: str) -> str:
    core = text.strip()  # wetext strips; the spaces around a tag stay
    if not _DIGIT.search(core):
        return text
    try:
        normalized = normalizer.normalize(core)
    except AssertionError:
        log.warning("wetext cannot normalise %r; using it as written", core[:200])
        return text
    start = text.index(core)
    return text[:start] + _WETEXT_ESCAPED.sub(r"\1", normalized) + text[start + len(core) :]


def _skips_normalization(text: str) -> bool:
    # Markup such as <|endofprompt|> would be mangled by the rules, so upstream passes such text as is.
    return text == "" or ("<|" in text and "|>" in text)


def _is_chinese(text: str) -> bool:
    return _CJK.search(text) is not None


def script_language(text: str) -> str:
    """The language ``text``'s letters are written for, where no recogniser said: ko for any
    Hangul, ja for any kana, zh for Chinese characters (the check the prompt's normalisation makes
    without a language), en for Latin letters, "" for none of these. Cantonese reads as zh."""
    import regex

    for language, script in (("ko", r"\p{Hangul}"), ("ja", r"[\p{Hiragana}\p{Katakana}]")):
        if regex.search(script, text):
            return language
    if _is_chinese(text):
        return "zh"
    return "en" if regex.search(r"\p{Latin}", text) else ""


def remove_control_characters(text: str) -> str:
    """``text`` without control characters other than tab and newline, and without lone surrogates.

    None of them can be spoken; "\\r\\n" line ends become "\\n".
    """
    return _CONTROL.sub("", text)


def unsupported_script(text: str) -> str | None:
    """The script name (e.g. "Cyrillic") of ``text``'s first letter when no letter of ``text`` is in a
    script the model reads (Latin, Han, kana, Hangul); None when one is, or when there are no letters.
    """
    import regex

    if regex.search(_SUPPORTED_LETTER, text) is not None:
        return None
    letter = regex.search(r"\p{L}", text)
    if letter is None:
        return None
    return unicodedata.name(letter[0], "unknown").split()[0].title()


def remove_blanks(text: str) -> str:
    """``text`` without the spaces that are not between two ASCII non-space characters.

    Spaces between Latin words survive; spaces next to CJK characters, or next to another space, go.
    """

    def ascii_word_char(i: int) -> bool:
        return 0 <= i < len(text) and text[i].isascii() and text[i] != " "

    kept = (c for i, c in enumerate(text) if c != " " or (ascii_word_char(i - 1) and ascii_word_char(i + 1)))
    return "".join(kept)


def has_nothing_to_read(text: str) -> bool:
    """True if ``text`` has no letter or digit: it is empty, or only punctuation, symbols (emoji
    included), marks, spaces or format characters. Upstream drops only ``[\\p{P}\\p{S}]*`` pieces,
    which lets "!! ??" or "❤️" (a variation selector is a mark) through to the LM."""
    import regex

    return regex.search(r"[\p{L}\p{N}]", text) is None


def log_short_sentences(sentences: Sequence[Sentence], normalized_prompt: str) -> list[Sentence]:
    """Log upstream's warning for each sentence with fewer than half the characters of the prompt text.

    Such sentences tend to come out badly (docs/model.md §3.8); nothing else changes. Returns them.
    """
    short = [s for s in sentences if len(s.text) < 0.5 * len(normalized_prompt)]
    for sentence in short:
        log.warning(
            "sentence %r is much shorter than the prompt text %r; this may sound worse",
            sentence.text,
            normalized_prompt,
        )
    return short
