"""Audio as bytes: float samples to 16-bit PCM, the WAV header in front of them, and the API's
compressed formats (MP3, Opus in Ogg, AAC in ADTS, FLAC), whole or chunk by chunk.

Every place that hands audio out (the HTTP API, the web UI's player and downloads) encodes here,
so the same samples give the same bytes everywhere. Mono; every format encodes the same 16-bit
samples (``to_int16``). Torch-free; PyAV is imported only by the compressed formats.
"""

import io
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


# The API's response formats (OpenAI's names) and their content types. Compressed formats are encoded
# by FFmpeg through PyAV, whose wheels carry the codecs (LAME, libopus, FFmpeg's AAC and FLAC).
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",  # Opus in Ogg (RFC 7845); audio/opus names the RTP payload
    "aac": "audio/aac",  # ADTS frames
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",  # raw 16-bit little-endian, no header
}
FORMATS = tuple(MEDIA_TYPES)
# FFmpeg muxer and encoder of each compressed format, and the bit rate (None: lossless).
_CONTAINERS = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 48_000),
    "aac": ("adts", "aac", 64_000),
    "flac": ("flac", "flac", None),
}
# Ogg pages of at most 20 ms, so a player gets each chunk's audio at once (the default is 1 s).
_MUXER_OPTIONS = {"ogg": {"page_duration": "20000"}}


class AudioEncoder:
    """One clip in one of FORMATS, encoded chunk by chunk: ``push`` gives the bytes ready so far,
    ``finish`` the rest. The concatenation is a file that ordinary players decode progressively
    (a WAV with unknown sizes, MP3 and ADTS frames, Ogg pages, FLAC frames). Not thread-safe: one
    caller at a time, in order. The compressed formats take a few ms a chunk: call from a thread."""

    def __init__(self, response_format: str, sample_rate: int):
        assert response_format in MEDIA_TYPES, response_format
        self.format = response_format
        self.sample_rate = sample_rate
        self._started = False
        compressed = response_format in _CONTAINERS
        self._muxer = _Muxer(response_format, sample_rate, _Sink()) if compressed else None

    def push(self, samples: np.ndarray) -> bytes:
        """Encode float samples in [-1, 1]; returns the bytes that can be sent now (maybe none)."""
        head = b""
        if not self._started:
            self._started = True
            head = wav_header(self.sample_rate, None) if self.format == "wav" else b""
        if self._muxer is None:
            return head + pcm16(samples)
        return self._muxer.encode(to_int16(samples))

    def finish(self) -> bytes:
        """The bytes after the last chunk (the encoder's buffered frames, the container's end)."""
        head = b"" if self._started else self.push(np.zeros(0, np.float32))
        return head if self._muxer is None else head + self._muxer.close()


def encode_clip(samples: np.ndarray, response_format: str, sample_rate: int) -> bytes:
    """A whole clip as one file of ``response_format``: its sizes filled in (WAV), the MP3's
    encoder delay and padding in its LAME header so players trim them."""
    if response_format == "wav":
        return wav(samples, sample_rate)
    if response_format == "pcm":
        return pcm16(samples)
    sink = io.BytesIO()  # seekable: the muxer rewrites its header at the end
    muxer = _Muxer(response_format, sample_rate, sink)
    muxer.encode(to_int16(samples))
    muxer.close()
    return sink.getvalue()


class _Sink:
    """A write-only, non-seekable file that hands out what was written since the last ``take``."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class _Muxer:
    """A PyAV container writing one mono 16-bit stream into ``sink``, flushed after every packet."""

    def __init__(self, response_format: str, sample_rate: int, sink: "_Sink | io.BytesIO"):
        import av  # heavy and only needed for the compressed formats

        muxer, codec, bit_rate = _CONTAINERS[response_format]
        options = {"flush_packets": "1", **_MUXER_OPTIONS.get(muxer, {})}
        self._av = av
        self._sink = sink
        self._container = av.open(sink, "w", format=muxer, container_options=options)
        self._stream = self._container.add_stream(codec, rate=sample_rate, layout="mono")
        if bit_rate is not None:
            self._stream.bit_rate = bit_rate
        self._container.start_encoding()  # the header now: even an empty clip is a valid file
        self._pts = 0

    def encode(self, samples: np.ndarray) -> bytes:
        if len(samples):
            frame = self._av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
            frame.sample_rate = self._stream.rate
            frame.pts = self._pts
            self._pts += len(samples)
            self._container.mux(self._stream.encode(frame))
        return self._take()

    def close(self) -> bytes:
        self._container.mux(self._stream.encode(None))
        self._container.close()
        return self._take()

    def _take(self) -> bytes:
        return self._sink.take() if isinstance(self._sink, _Sink) else b""
