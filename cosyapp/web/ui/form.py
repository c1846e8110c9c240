"""The speech form, defined once: its fields name the page's inputs, the parameters of the named
endpoints ``/speak`` and ``/speak_clip`` (in this order), and what the handlers read."""

from dataclasses import dataclass, fields
from typing import Any

from cosyapp.engine.request import check_options, check_request, shown
from cosyapp.errors import UserError


@dataclass(frozen=True)
class Refused:
    """Each value of a batched request that Gradio could not preprocess; ``error`` is its answer."""

    error: UserError


@dataclass(frozen=True)
class SpeechForm:
    """One request's form values as Gradio hands them over: as the client sent them (see
    ``web/ui/inputs.py``), so of any type until ``check`` has passed.

    ``voice_id`` is a library voice id or RECORDING (the recording in the form); ``recording`` the
    path of an uploaded file; ``seed`` None draws a fresh one; ``session`` is the browser's session
    id ("" for API callers).
    """

    text: str
    voice_id: str
    recording: str | None
    prompt_text: str
    speed: float
    seed: float | None
    session: str

    def check(self, max_chars: int, needs_text: bool = True) -> None:
        """Raise the ``UserError`` of the first rule the form breaks: a value Gradio refused
        (``Refused``), the request rules (``check_request``: text, speed, seed; only speed and seed
        without ``needs_text``, for voice conversion), then the form's own text fields: voice id,
        transcript and session must be strings (or null)."""
        for field in fields(self):
            if isinstance(value := getattr(self, field.name), Refused):
                raise value.error
        if needs_text:
            check_request(self.text, self.speed, self.seed, max_chars)
        else:
            check_options(self.speed, self.seed)
        as_text(self.voice_id, "voice")
        as_text(self.prompt_text, "transcript")
        as_text(self.session, "session")

    @classmethod
    def names(cls) -> list[str]:
        return [field.name for field in fields(cls)]

    @classmethod
    def inputs(cls, **components: Any) -> dict[str, Any]:
        """``inputs_kwargs`` for an event: one component per field, in field order."""
        assert set(components) == set(cls.names()), sorted(components)
        return {name: components[name] for name in cls.names()}

    @classmethod
    def batch(cls, values: dict[str, list]) -> list["SpeechForm"]:
        """The forms of a Gradio batch, which hands each field as a list with one entry per request."""
        columns = [values[name] for name in cls.names()]
        return [cls(*row) for row in zip(*columns, strict=True)]


def as_text(value: object, what: str) -> str:
    """The value of a text field named ``what`` ("" for null); raises ``UserError`` for anything
    but a string, which a client can send where the page sends text."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"The {what} must be a string, got {shown(value)}.")
    return value
