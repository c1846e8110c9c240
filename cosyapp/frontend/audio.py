"""Read a voice prompt recording and reject the ones the frontend cannot use (docs/model.md §3.3, §3.8).

Upstream reads the file, averages the channels to mono and asserts on the rate and the length; here
every such problem becomes a ``VoiceError`` subclass whose message can be shown to the user as it is.
Files soundfile cannot read (M4A/AAC, MP4, WebM/Opus, 3GP/AMR) are decoded by FFmpeg (``decode.py``).
Nothing is trimmed or normalised here, as upstream; uploads are prepared apart (``prepare.py``).
"""

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from cosyapp.errors import VoiceError
from cosyapp.frontend.decode import DecodeError, decode_with_ffmpeg

MIN_SAMPLE_RATE = 16_000  # the speech tokenizer and CAM++ work at 16 kHz; upstream never upsamples
MIN_PROMPT_SECONDS = 1.0  # shorter prompts give too few tokens and frames to clone a voice from
MAX_PROMPT_SECONDS = 30.0  # the speech tokenizer's limit
SILENCE_PEAK = 1e-3  # -60 dBFS: a peak below this is silence or a muted microphone
MAX_FILE_MB = 20  # a 30 s prompt is ~5 MB as 44.1 kHz stereo 16-bit WAV
FORMATS = "WAV, FLAC, OGG, MP3, M4A/AAC, MP4, WebM/Opus or 3GP"


class UnreadableAudioError(VoiceError):
    """Not audio in a format soundfile or FFmpeg decodes, or a corrupt file."""


class EmptyAudioError(VoiceError):
    """The recording holds no samples."""


class SampleRateTooLowError(VoiceError):
    """Sampled below 16 kHz."""


class NonFiniteAudioError(VoiceError):
    """Some samples are NaN or infinite."""


class AudioTooShortError(VoiceError):
    """Shorter than MIN_PROMPT_SECONDS."""


class AudioTooLongError(VoiceError):
    """Longer than the limit (MAX_PROMPT_SECONDS unless the caller sets another)."""


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
    source: AudioSource,
    max_mb: float = MAX_FILE_MB,
    role: str = "a voice prompt",
    max_seconds: float = MAX_PROMPT_SECONDS,
) -> PromptAudio:
    """Read and validate a prompt recording.

    Takes a file path, the bytes of a file (anything soundfile decodes: WAV, FLAC, OGG, MP3, ...; else
    anything FFmpeg decodes: M4A/AAC, MP4, WebM/Opus, 3GP/AMR, ...), or a Gradio ``(rate, array)``
    tuple whose array is int or float, shaped (N,) or (N, channels); a ``PromptAudio`` (already
    validated) is returned as it is. Channels are averaged to mono.
    A file larger than ``max_mb`` MiB is refused before it is read; one longer than ``max_seconds``
    (uploads that are cut to their best part afterwards may be longer than a prompt) after reading
    only that much. Returns the samples at the recording's own rate.
    Raises a ``VoiceError`` subclass naming the problem when the recording is unusable; its
    message names the recording's ``role`` (the speech to convert has the same limits).
    """
    if isinstance(source, PromptAudio):
        return source
    if isinstance(source, tuple):
        rate, array = source
        samples = _to_float(np.asarray(array))
    else:
        samples, rate = _read_file(source, int(max_mb * 2**20), role, max_seconds)
    if samples.ndim not in (1, 2):
        raise UnreadableAudioError(f"The recording has shape {samples.shape}; expected (samples, channels).")
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    _validate(samples, int(rate), role, max_seconds)
    return PromptAudio(samples=samples, sample_rate=int(rate))


def _read_file(
    source: str | Path | bytes, max_bytes: int, role: str, max_seconds: float
) -> tuple[np.ndarray, int]:
    """Decode a file of at most ``max_bytes`` without reading more than just over ``max_seconds``."""
    if isinstance(source, bytes):
        size, name = len(source), "the uploaded file"
    else:
        source = Path(source)
        if not source.is_file():
            raise FileNotFoundError(f"prompt audio {source} does not exist")
        size, name = source.stat().st_size, source.name
    if size == 0:
        raise EmptyAudioError("The recording is empty: the file has no content.")
    if size > max_bytes:
        raise FileTooLargeError(
            f"The file is too large ({size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:g} MB). "
            f"{role[:1].upper() + role[1:]} needs only 1-30 s of audio."
        )
    try:
        with sf.SoundFile(io.BytesIO(source) if isinstance(source, bytes) else source) as f:
            rate = f.samplerate
            _check_rate(rate, role)
            _check_not_too_long(f.frames, rate, role, max_seconds)
            return f.read(frames=int(max_seconds * rate) + 1, dtype="float32", always_2d=True), rate
    except sf.LibsndfileError:
        pass  # not a format libsndfile knows (or a corrupt file): FFmpeg decides
    try:
        samples, rate, seconds = decode_with_ffmpeg(source, max_seconds)
    except DecodeError as err:
        raise UnreadableAudioError(
            f"Could not read {name} as audio: it is corrupt or not in a format we can decode "
            f"(use {FORMATS}). Details: {err}"
        ) from err
    _check_rate(rate, role)
    _check_not_too_long(round(seconds * rate), rate, role, max_seconds)
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


def _validate(samples: np.ndarray, rate: int, role: str, max_seconds: float) -> None:
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
    _check_not_too_long(len(samples), rate, role, max_seconds)
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


def _check_not_too_long(frames: int, rate: int, role: str, max_seconds: float) -> None:
    seconds = frames / rate
    if seconds > max_seconds:
        raise AudioTooLongError(
            f"The recording is too long ({seconds:.1f} s): {role} may be at most "
            f"{max_seconds:g} s. Trim it and try again."
        )
