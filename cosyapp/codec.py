"""Audio as bytes: float samples to 16-bit PCM, and the WAV header in front of them.

Every place that hands audio out (the HTTP API, the web UI's player and downloads) encodes here,
so the same samples give the same bytes everywhere. Mono, 16-bit, little-endian. Torch-free.
"""

import struct

import numpy as np

WAV_HEADER_BYTES = 44
# RIFF and data sizes of a WAV whose length is unknown when its header is sent (a stream); players
# read such a file to its end.
UNKNOWN_SIZE = 0xFFFFFFFF
FULL_SCALE = 32767  # +-1.0 maps to +-32767: symmetric, so -32768 is never written


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] as int16: scaled by 32767, rounded to the nearest step (ties to
    even), values outside [-1, 1] clipped."""
    return np.rint(np.clip(samples, -1.0, 1.0) * FULL_SCALE).astype(np.int16)


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples as raw little-endian 16-bit PCM (``to_int16``'s values)."""
    return to_int16(samples).astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """The 44-byte header of mono 16-bit PCM at ``sample_rate`` followed by ``data_bytes`` bytes;
    None (a stream of unknown length) writes UNKNOWN_SIZE for both sizes."""
    assert data_bytes is None or 0 <= data_bytes <= UNKNOWN_SIZE - 36, data_bytes
    riff = UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    data = UNKNOWN_SIZE if data_bytes is None else data_bytes
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", riff, b"WAVE",
        b"fmt ", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16,
        b"data", data,
    )  # fmt: skip


def wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """A complete mono 16-bit WAV file of ``samples``."""
    data = pcm16(samples)
    return wav_header(sample_rate, len(data)) + data
