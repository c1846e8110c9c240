"""The errors a user can cause (or wait out), as one family: ``UserError`` and its kinds.

Whatever raises one, the edges show its message as it is: the web UI as a toast, the HTTP API as
OpenAI's error JSON (``web/api_errors.py``). Any other exception is a server error: logged with its
traceback and answered without details. Torch-free, so every layer can raise these.
"""


class UserError(Exception):
    """A problem with what the user sent; ``message`` is written for them, one sentence or two.

    ``param`` names the request field at fault by its HTTP API name (None: the request as a whole).
    """

    param: str | None = None

    def __init__(self, message: str):
        # Raised from many places, shown in two: every message starts as a sentence does.
        self.message = message[:1].upper() + message[1:]
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message  # not KeyError's quoted repr for VoiceNotFoundError


class TextError(UserError, ValueError):
    """Text that cannot be spoken: empty, too long, nothing to read aloud, an unsupported script."""

    param = "input"


class VoiceError(UserError, ValueError):
    """A voice that cannot be used or saved: an unusable recording, its transcript, its name."""

    param = "voice"


class VoiceNotFoundError(VoiceError, KeyError):
    """No voice with this id is visible to the asking session (KeyError: a failed lookup)."""

    def __init__(self, voice_id: str):
        self.voice_id = voice_id
        super().__init__(f"Voice {voice_id!r} not found; pick one of the listed voices.")

    def __reduce__(self):  # rebuilt from its id when it crosses a process boundary
        return type(self), (self.voice_id,)


class ParamError(UserError, ValueError):
    """A request parameter out of its range (speed, seed, response format); ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        return type(self), (self.message, self.param)


class BusyError(UserError):
    """The server is at its admission limits; the message says to try again."""
