"""The speech form, defined once: its fields name the page's inputs, the parameters of the named
endpoints ``/speak`` and ``/speak_clip`` (in this order), and what the handlers read."""

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SpeechForm:
    """One request's form values as Gradio hands them over.

    ``voice_id`` is a library voice id or RECORDING (the recording in the form); ``seed`` None
    draws a fresh one; ``session`` is the browser's session id ("" for API callers).
    """

    text: str
    voice_id: str
    recording: str | None
    prompt_text: str
    speed: float
    seed: float | None
    session: str

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
