"""What a session asks the Pipeline for, and the rules every such request obeys.

The web UI, the HTTP API and the Pipeline check requests here and nowhere else, so the same bad
request gets the same message (a ``UserError``) wherever it comes from. Torch-free.
"""

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cosyapp.errors import ParamError, TextError
from cosyapp.frontend.modes import VOICE_CONVERSION, ZERO_SHOT, check_mode
from cosyapp.frontend.text import check_text

if TYPE_CHECKING:  # the voice library needs torch; a request only carries its voice
    from cosyapp.frontend.voices import Voice

MIN_SPEED, MAX_SPEED = 0.5, 2.0
MAX_SEED = 2**63 - 1


def shown(value: object, limit: int = 40) -> str:
    """``value`` as a message quotes it: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_number(value: object) -> bool:
    """Whether ``value`` is an int or float (a bool is not, though Python counts it as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_options(speed: object, seed: object) -> None:
    """Raise ``ParamError`` when ``speed`` is not a number in [MIN_SPEED, MAX_SPEED] (NaN is not) or
    a given ``seed`` is not a whole number in [0, MAX_SEED]; seed None draws a fresh one.

    Any value is checked, not only numbers: the web UI hands on what a client sent."""
    if not (is_number(speed) and MIN_SPEED <= speed <= MAX_SPEED):
        raise ParamError(f"Speed must be between {MIN_SPEED} and {MAX_SPEED}, got {shown(speed)}.", "speed")
    whole = is_number(seed) and (not isinstance(seed, float) or seed.is_integer())  # not NaN, infinities
    if seed is not None and not (whole and 0 <= seed <= MAX_SEED):
        raise ParamError(f"The seed must be a whole number from 0 to {MAX_SEED}, got {shown(seed)}.", "seed")


def check_request(text: object, speed: object, seed: object, max_chars: int) -> None:
    """The request rules, text first: raises ``TextError`` (a text that is not a string, or see
    ``check_text``) or ``ParamError``.

    The edges call it before they look up or compute the voice, which can take a while."""
    if not isinstance(text, str):
        raise TextError(f"The text must be a string, got {shown(text)}.")
    check_text(text, max_chars)
    check_options(speed, seed)


@dataclass(frozen=True)
class SynthesisRequest:
    """What a session asks for. ``seed`` None draws a fresh one; the same seed gives the same audio.

    ``client`` names who asks (a session, an API key, an address) for fair admission; None counts
    the request as a client of its own.

    ``mode`` is one of CosyVoice 2's modes (``frontend/modes.py``): ``instruction`` is for instruct2;
    voice conversion (``vc``) speaks ``source_tokens`` (the speech to convert) in ``voice`` and
    takes no text.
    """

    text: str
    voice: "Voice"
    speed: float = 1.0
    seed: int | None = None
    streaming: bool = True
    client: str | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    mode: str = ZERO_SHOT
    instruction: str | None = None
    source_tokens: tuple[int, ...] = ()

    def validate(self, max_chars: int) -> None:
        """Raise the ``UserError`` of the first rule this request breaks (``check_mode``, then
        ``check_request``, or for voice conversion ``check_options``), with ``max_chars`` the longest
        text the caller accepts."""
        check_mode(self.mode, self.instruction, self.source_tokens)
        if self.mode == VOICE_CONVERSION:
            check_options(self.speed, self.seed)
        else:
            check_request(self.text, self.speed, self.seed, max_chars)
