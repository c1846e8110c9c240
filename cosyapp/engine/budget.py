"""How much audio one request may make, so that no request, however its text or a degenerate
generation runs, costs the shared engine more than its text is worth.

A sentence may take its syllables at the slowest speaking rate served (``--slowest-speech-rate``,
0 for no such limit), at least MIN_SENTENCE_AUDIO_S; a request at most ``--max-request-audio-s`` in
all. Both are counted
in speech tokens (25 per second of audio at speed 1) and enforced twice: in the LM request's
``max_tokens``, and by the Pipeline, which stops reading a sentence's tokens at its limit. A request
that reaches a limit ends cleanly with what was made: its stream yields an empty ``AudioChunk``
carrying a note (see ``Pipeline.stream``).
"""

import math
from dataclasses import dataclass

from cosyapp.frontend.voice_rules import syllables

TOKENS_PER_S = 25  # CosyVoice 2's speech tokens per second of audio
MIN_SENTENCE_AUDIO_S = 2.0  # short sentences ("Hi.") still get room for a natural reading


@dataclass(frozen=True)
class AudioBudget:
    """The limits of a server: ``slowest_rate`` syllables per second (0: none per sentence) and
    ``max_request_s`` seconds per request (inf: none)."""

    slowest_rate: float
    max_request_s: float

    def sentence_tokens(self, text: str) -> float:
        """The most speech tokens the sentence ``text`` (normalised) may make (inf: no limit)."""
        if self.slowest_rate == 0:
            return math.inf
        seconds = max(MIN_SENTENCE_AUDIO_S, syllables(text) / self.slowest_rate)
        return round(seconds * TOKENS_PER_S)

    def request(self) -> "RequestBudget":
        """The budget of one new request."""
        tokens = self.max_request_s * TOKENS_PER_S
        return RequestBudget(self, math.floor(tokens) if math.isfinite(tokens) else tokens)


@dataclass
class RequestBudget:
    """What is left of one request's budget, in speech tokens."""

    limits: AudioBudget
    left: float

    def cap(self, text: str, index: int, upstream_max: int) -> tuple[int, str | None]:
        """(max tokens, note if that many are made) for sentence ``index`` (from 0), ``text``.

        The note is None when upstream's own maximum (``upstream_max``) is the binding limit."""
        sentence = self.limits.sentence_tokens(text)
        if min(sentence, self.left) >= upstream_max:
            return upstream_max, None
        if self.left <= sentence:
            return int(self.left), request_note(self.limits.max_request_s)
        return int(sentence), sentence_note(index, sentence / TOKENS_PER_S)

    def spend(self, tokens: int) -> None:
        """Count ``tokens`` made by the request's latest sentence."""
        self.left = max(0, self.left - tokens)


NO_BUDGET = AudioBudget(0.0, math.inf)  # upstream's limits only (20 speech tokens per text token)


def request_note(seconds: float) -> str:
    """The note of a request stopped at the request limit of ``seconds``."""
    return (
        f"The audio stops early: this request reached the server's limit of {seconds:g} s of audio "
        "per request. Send the rest of the text in another request."
    )


def sentence_note(index: int, seconds: float) -> str:
    """The note of sentence ``index`` (from 0) cut at its limit of ``seconds``. ASCII: it may go in
    a header."""
    return (
        f"Sentence {index + 1} was cut short at the server's limit of {seconds:.1f} s of audio for a "
        "sentence of its length."
    )
