"""Read a voice prompt recording and reject the ones the frontend cannot use (docs/model.md §3.3, §3.8).

Upstream reads the file, averages the channels to mono and asserts on the rate and the length; here
every such problem becomes a ``VoiceError`` subclass whose message can be shown to the user as it is.
No trimming, loudness normalisation or silence removal is applied, as upstream.
"""

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from cosyapp.errors import VoiceError

MIN_SAMPLE_RATE = 16_000  # the speech tokenizer and CAM++ work at 16 kHz; upstream never upsamples
MIN_PROMPT_SECONDS = 1.0  # shorter prompts give too few tokens and frames to clone a voice from
MAX_PROMPT_SECONDS = 30.0  # the speech tokenizer's limit
SILENCE_PEAK = 1e-3  # -60 dBFS: a peak below this is silence or a muted microphone
MAX_FILE_MB = 20  # a 30 s prompt is ~5 MB as 44.1 kHz stereo 16-bit WAV


class UnreadableAudioError(VoiceError):
    """Not audio in a format soundfile decodes, or a corrupt file."""


class EmptyAudioError(VoiceError):
    """The recording holds no samples."""


class SampleRateTooLowError(VoiceError):
    """Sampled below 16 kHz."""


class NonFiniteAudioError(VoiceError):
    """Some samples are NaN or infinite."""


class AudioTooShortError(VoiceError):
    """Shorter than MIN_PROMPT_SECONDS."""


class AudioTooLongError(VoiceError):
    """Longer than MAX_PROMPT_SECONDS."""


class SilentAudioError(VoiceError):
    """The peak level is below SILENCE_PEAK."""


class FileTooLargeError(VoiceError):
    """The file is larger than the upload limit (checked before it is read)."""


@dataclass(frozen=True, eq=False)
class PromptAudio:
    """A validated prompt recording: samples (N,) float32 mono at sample_rate Hz.

    Samples are in [-1, 1] for PCM sources; float sources are kept as they are, as upstream.
    """

    samples: np.ndarray
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


AudioSource = str | Path | bytes | tuple[int, np.ndarray] | PromptAudio


def load_prompt_audio(
    source: AudioSource, max_mb: float = MAX_FILE_MB, role: str = "a voice prompt"
) -> PromptAudio:
    """Read and validate a prompt recording.

    Takes a file path, the bytes of a file (anything soundfile decodes: WAV, FLAC, OGG, MP3, ...),
    or a Gradio ``(rate, array)`` tuple whose array is int or float, shaped (N,) or (N, channels);
    a ``PromptAudio`` (already validated) is returned as it is. Channels are averaged to mono.
    A file larger than ``max_mb`` MiB is refused before it is read.
    Returns the samples at the recording's own rate.
    Raises a ``VoiceError`` subclass naming the problem when the recording is unusable; its
    message names the recording's ``role`` (the speech to convert has the same limits).
    """
    if isinstance(source, PromptAudio):
        return source
    if isinstance(source, tuple):
        rate, array = source
        samples = _to_float(np.asarray(array))
    else:
        samples, rate = _read_file(source, int(max_mb * 2**20), role)
    if samples.ndim not in (1, 2):
        raise UnreadableAudioError(f"The recording has shape {samples.shape}; expected (samples, channels).")
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    _validate(samples, int(rate), role)
    return PromptAudio(samples=samples, sample_rate=int(rate))


def _read_file(source: str | Path | bytes, max_bytes: int, role: str) -> tuple[np.ndarray, int]:
    """Decode a file of at most ``max_bytes`` without reading more than just over the length limit."""
    if isinstance(source, bytes):
        size, handle, name = len(source), io.BytesIO(source), "the uploaded file"
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"prompt audio {path} does not exist")
        size, handle, name = path.stat().st_size, path, path.name
    if size == 0:
        raise EmptyAudioError("The recording is empty: the file has no content.")
    if size > max_bytes:
        raise FileTooLargeError(
            f"The file is too large ({size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:g} MB). "
            f"{role[:1].upper() + role[1:]} needs only 1-30 s of audio."
        )
    try:
        with sf.SoundFile(handle) as f:
            rate = f.samplerate
            _check_rate(rate, role)
            _check_not_too_long(f.frames, rate, role)
            samples = f.read(frames=int(MAX_PROMPT_SECONDS * rate) + 1, dtype="float32", always_2d=True)
    except sf.LibsndfileError as err:
        raise UnreadableAudioError(
            f"Could not read {name} as audio: it is corrupt or not in a format we can decode "
            f"(use WAV, FLAC, OGG or MP3). Details: {err.error_string}"
        ) from err
    return samples, rate


def _to_float(array: np.ndarray) -> np.ndarray:
    """Integer PCM to float in [-1, 1] as soundfile scales it; float arrays are taken as they are."""
    if np.issubdtype(array.dtype, np.signedinteger):
        return array.astype(np.float32) / -np.iinfo(array.dtype).min
    if np.issubdtype(array.dtype, np.unsignedinteger):
        mid = (np.iinfo(array.dtype).max + 1) / 2
        return (array.astype(np.float32) - mid) / mid
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(np.float32)
    raise UnreadableAudioError(f"The recording's samples have type {array.dtype}, which is not audio.")


def _validate(samples: np.ndarray, rate: int, role: str) -> None:
    if samples.size == 0:
        raise EmptyAudioError("The recording is empty: it contains no samples.")
    _check_rate(rate, role)
    if not np.isfinite(samples).all():
        raise NonFiniteAudioError("The recording is damaged: some samples are not numbers (NaN or infinite).")
    seconds = len(samples) / rate
    if seconds < MIN_PROMPT_SECONDS:
        raise AudioTooShortError(
            f"The recording is too short ({seconds:.2f} s): {role} needs at least "
            f"{MIN_PROMPT_SECONDS:g} s of speech."
        )
    _check_not_too_long(len(samples), rate, role)
    peak = float(np.abs(samples).max())
    if peak < SILENCE_PEAK:
        raise SilentAudioError(
            f"The recording is silent (peak level below {20 * np.log10(SILENCE_PEAK):.0f} dBFS): "
            "check the microphone or the file."
        )


def _check_rate(rate: int, role: str) -> None:
    if rate < MIN_SAMPLE_RATE:
        raise SampleRateTooLowError(
            f"The recording's sample rate is {rate} Hz; {role} needs at least "
            f"{MIN_SAMPLE_RATE // 1000} kHz. Record or export it at 16 kHz or more."
        )


def _check_not_too_long(frames: int, rate: int, role: str) -> None:
    seconds = frames / rate
    if seconds > MAX_PROMPT_SECONDS:
        raise AudioTooLongError(
            f"The recording is too long ({seconds:.1f} s): {role} may be at most "
            f"{MAX_PROMPT_SECONDS:g} s. Trim it and try again."
        )
