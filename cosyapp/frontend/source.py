"""The speech to convert (voice conversion): a recording read and checked as a voice prompt is, then
turned into speech tokens by the speech tokenizer (upstream's ``frontend_vc``, docs/model.md §4.3).

Its limits are a prompt's: at least 16 kHz (upstream asserts it), 1-30 s (30 s is the speech
tokenizer's limit), not silent; its messages name it as the speech to convert.
"""

from typing import TYPE_CHECKING

import torch

from cosyapp.errors import VoiceError
from cosyapp.frontend.audio import MAX_FILE_MB, AudioSource, load_prompt_audio

if TYPE_CHECKING:
    from cosyapp.frontend.voice import VoiceFrontend

ROLE = "the speech to convert"


class SourceSpeechError(VoiceError):
    """A recording that cannot be converted; ``param`` is the API's field for it."""

    param = "file"


def source_tokens(
    frontend: "VoiceFrontend", source: AudioSource, max_mb: float = MAX_FILE_MB
) -> tuple[int, ...]:
    """The speech tokens (25 per second) of the recording ``source`` (what ``load_prompt_audio``
    takes), read at its own rate and resampled to 16 kHz as upstream. Raises ``SourceSpeechError``
    with the reason when the recording is unusable. Runs the tokenizer: call it off the event loop."""
    from cosyapp.frontend.voice import TOKENIZER_RATE, resample

    try:
        audio = load_prompt_audio(source, max_mb, role=ROLE)
    except VoiceError as error:
        raise SourceSpeechError(error.message) from error
    wave16k = resample(torch.from_numpy(audio.samples), audio.sample_rate, TOKENIZER_RATE)
    return tuple(frontend.speech_tokens(wave16k).tolist())
