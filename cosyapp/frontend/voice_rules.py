"""What a voice made from a recording must have: a display name, and a transcript that can be the
recording's (checked with a rough syllable count against the recording's length)."""

import re
import unicodedata
from typing import TYPE_CHECKING

from cosyapp.errors import VoiceError
from cosyapp.frontend.text import remove_control_characters

if TYPE_CHECKING:
    from cosyapp.frontend.audio import PromptAudio

MAX_NAME_CHARS = 60
MAX_PROMPT_TEXT_CHARS = 500
# Syllables per second a transcript may claim for its recording; real prompts read 3-4 (built-in
# voices), so only a transcript of another recording, or none, falls outside.
MAX_SYLLABLES_PER_S = 12.0
MIN_SYLLABLES_PER_S = 0.2


class PromptTextError(VoiceError):
    """A transcript that is missing, too long, or obviously not that of its recording."""


def sanitize_name(name: str) -> str:
    """A display name safe to store and show: printable, single-spaced, at most 60 characters."""
    text = unicodedata.normalize("NFC", name)
    text = "".join(ch if unicodedata.category(ch)[0] not in "CZ" else " " for ch in text)
    text = re.sub(r"[<>/\\`]", "", text)
    text = " ".join(text.split())[:MAX_NAME_CHARS].strip()
    if not text:
        raise VoiceError("give the voice a name made of letters, digits or punctuation")
    return text


def syllables(text: str) -> float:
    """A rough syllable count: one per Chinese/Japanese/Korean character, one per three other letters
    or digits (English averages about three letters per syllable)."""
    import regex

    syllabic = len(regex.findall(r"[\p{Han}\p{Hiragana}\p{Katakana}\p{Hangul}]", text))
    return syllabic + (len(regex.findall(r"[\p{L}\p{N}]", text)) - syllabic) / 3


def check_prompt_text(prompt_text: str, audio: "PromptAudio") -> str:
    """The transcript of ``audio`` with control characters removed and spaces collapsed.

    Raises ``PromptTextError`` when it is empty, longer than MAX_PROMPT_TEXT_CHARS, or claims far
    more or far fewer syllables than the recording can hold (outside MIN/MAX_SYLLABLES_PER_S).
    """
    text = " ".join(remove_control_characters(prompt_text or "").split())
    if not text:
        raise PromptTextError("type what is said in the recording: the model needs its transcript")
    if len(text) > MAX_PROMPT_TEXT_CHARS:
        raise PromptTextError(f"the transcript has {len(text)} characters; at most {MAX_PROMPT_TEXT_CHARS}")
    rate = syllables(text) / audio.seconds
    if rate > MAX_SYLLABLES_PER_S:
        raise PromptTextError(
            f"the transcript is too long for the recording (about {rate:.0f} syllables per second of "
            "audio): type exactly what is said in this recording"
        )
    if rate < MIN_SYLLABLES_PER_S:
        raise PromptTextError(
            f"the transcript is too short for the recording (about {syllables(text):.0f} syllables "
            f"in {audio.seconds:.1f} s): type everything that is said in this recording"
        )
    return text
