"""Decode a recording that soundfile cannot read: phone and browser formats through FFmpeg's codecs.

soundfile (libsndfile) reads WAV, FLAC, OGG/Vorbis/Opus and MP3. Phones record M4A (AAC in MP4),
browsers WebM (Opus), old phones 3GP (AMR): those go through PyAV, whose wheels ship FFmpeg's
decoders (the API's encoders use it already). Samples stay at the file's own rate, every channel
kept, as soundfile returns them.
"""

import io
from pathlib import Path

import numpy as np


class DecodeError(Exception):
    """FFmpeg could not find or decode an audio track; the message says why."""


def decode_with_ffmpeg(source: Path | bytes, max_seconds: float) -> tuple[np.ndarray, int, float]:
    """(samples (N, channels) float32 in [-1, 1], sample rate, seconds) of the first audio track.

    Decodes at most ``max_seconds`` and one sample more, so a caller can tell a recording that is
    too long without decoding all of it; ``seconds`` is the length the container declares (else the
    decoded length). The track's declared duration, when it has one, cuts the encoder's padding
    after the last sample (AAC pads its last frame).
    Raises ``DecodeError`` for a file FFmpeg cannot open, one without audio, or a corrupt stream.
    """
    import av

    handle = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    try:
        with av.open(handle, mode="r") as container:
            track = next((s for s in container.streams if s.type == "audio"), None)
            if track is None:
                raise DecodeError("the file has no audio track")
            rate = track.codec_context.sample_rate or track.rate
            if not rate:
                raise DecodeError("the audio track declares no sample rate")
            limit = int(max_seconds * rate) + 1
            declared = None
            if track.duration is not None and track.time_base is not None:
                declared = float(track.duration * track.time_base)
                limit = min(limit, round(declared * rate))
            elif container.duration is not None:
                declared = container.duration / av.time_base
            pieces = _decode(container, track, limit)
    except av.FFmpegError as err:
        raise DecodeError(str(err)) from err
    samples = np.concatenate(pieces)[:limit] if pieces else np.zeros((0, 1), np.float32)
    return samples, rate, max(declared or 0.0, len(samples) / rate)


def _decode(container, track, limit: int) -> list[np.ndarray]:
    """Frames of ``track`` as packed float32 (N, channels) blocks, until ``limit`` samples."""
    import av

    # Packed float at the track's own rate and layout: no resampling, no mixing of channels here.
    converter = av.AudioResampler(format="flt")
    pieces, count = [], 0
    for frame in container.decode(track):
        for converted in converter.resample(frame):
            block = converted.to_ndarray().reshape(-1, len(converted.layout.channels))
            pieces.append(block)
            count += len(block)
        if count >= limit:
            break
    return pieces
