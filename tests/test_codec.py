"""The audio codec: float samples to 16-bit PCM with one rounding rule, and WAV headers."""

import io
import struct
import wave

import numpy as np
import soundfile as sf

from cosyapp.codec import UNKNOWN_SIZE, WAV_HEADER_BYTES, pcm16, to_int16, wav, wav_header

STEP = 1 / 32767


def test_samples_round_to_the_nearest_step():
    samples = np.array([0.0, 0.4 * STEP, 0.6 * STEP, -0.6 * STEP, 100.4 * STEP, 100.6 * STEP], np.float32)
    assert to_int16(samples).tolist() == [0, 0, 1, -1, 100, 101]


def test_full_scale_and_beyond_is_clipped_symmetrically():
    samples = np.array([1.0, -1.0, 1.5, -2.0, np.inf, -np.inf], np.float32)
    assert to_int16(samples).tolist() == [32767, -32767, 32767, -32767, 32767, -32767]


def test_pcm_is_little_endian_int16_of_the_rounded_samples():
    samples = np.array([0.5, -0.25, 0.6 * STEP], np.float32)
    assert pcm16(samples) == struct.pack("<3h", 16384, -8192, 1)


def test_a_known_length_header_gives_its_sizes_and_format():
    header = wav_header(24_000, 960)
    assert len(header) == WAV_HEADER_BYTES
    riff, data = struct.unpack("<I", header[4:8])[0], struct.unpack("<I", header[40:44])[0]
    assert (riff, data) == (36 + 960, 960)
    with wave.open(io.BytesIO(header + bytes(960))) as reader:
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (24_000, 1, 2)
        assert reader.getnframes() == 480


def test_a_stream_header_has_unknown_sizes():
    header = wav_header(24_000, None)
    assert len(header) == WAV_HEADER_BYTES
    assert struct.unpack("<I", header[4:8])[0] == struct.unpack("<I", header[40:44])[0] == UNKNOWN_SIZE
    known = wav_header(24_000, 960)
    assert header[:4] + header[8:40] == known[:4] + known[8:40]  # only the two sizes differ


def test_a_wav_file_decodes_to_the_rounded_samples():
    samples = np.array([0.0, 0.5, -0.5, 0.6 * STEP, 1.5], np.float32)
    data = wav(samples, 16_000)
    assert len(data) == WAV_HEADER_BYTES + 2 * len(samples)
    decoded, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 16_000 and decoded.tolist() == to_int16(samples).tolist() == [0, 16384, -16384, 1, 32767]
