"""Prompt recordings in phone and browser formats, and their preparation (trim, best part, level).

The compressed files are made here from the repository's AISHELL WAVs by the bundled ffmpeg
(imageio-ffmpeg). Codec tolerance: decoded, resampled to the WAV's 16 kHz and compared sample by
sample at lag 0, both files keep the WAV's exact length and a signal-to-error ratio of 32.6-33.1 dB
through AAC at 128 kb/s and 19.0-24.6 dB through Opus at 64 kb/s (measured with this ffmpeg; Opus is
perceptual, its waveform error is larger); the tests require 30 dB and 15 dB.
"""

import subprocess

import imageio_ffmpeg
import numpy as np
import pytest
import torch

from cosyapp.frontend.audio import (
    AudioTooLongError,
    AudioTooShortError,
    PromptAudio,
    SampleRateTooLowError,
    UnreadableAudioError,
    load_prompt_audio,
)
from cosyapp.frontend.prepare import (
    FRAME_S,
    HOP_S,
    MAX_PEAK,
    MAX_SECONDS,
    MAX_UPLOAD_SECONDS,
    PAD_S,
    TARGET_DBFS,
    frame_levels,
    prepare_prompt,
    read_upload,
    speech_frames,
)
from cosyapp.frontend.voice import resample
from cosyapp.frontend.voices import ASSETS_VOICES

AISHELL = [ASSETS_VOICES / "zh-aishell-w0121.wav", ASSETS_VOICES / "zh-aishell-w0122.wav"]
# suffix: ffmpeg codec arguments, and the signal-to-error ratio (dB) the decoded samples keep
FORMATS = {
    "m4a": ["-c:a", "aac", "-b:a", "128k"],
    "mp4": ["-c:a", "aac", "-b:a", "128k"],
    "webm": ["-c:a", "libopus", "-b:a", "64k"],
}
MIN_SNR_DB = {"m4a": 30.0, "mp4": 30.0, "webm": 15.0}


def ffmpeg(source, target, *args: str) -> None:
    """Convert ``source`` to ``target`` with the ffmpeg binary cosyapp bundles."""
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y", "-i", str(source), *args, str(target)]
    subprocess.run(command, check=True)


def convert(wav, tmp_path, suffix: str):
    target = tmp_path / f"{wav.stem}.{suffix}"
    ffmpeg(wav, target, *FORMATS[suffix])
    return target


def snr_db(reference: np.ndarray, decoded: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference**2) / np.sum((reference - decoded) ** 2)))


def at_16k(audio: PromptAudio) -> np.ndarray:
    return resample(torch.from_numpy(audio.samples), audio.sample_rate, 16_000).numpy()


@pytest.mark.parametrize("wav", AISHELL, ids=lambda p: p.stem)
@pytest.mark.parametrize("suffix", FORMATS)
def test_a_compressed_recording_decodes_to_the_samples_of_its_wav(tmp_path, wav, suffix):
    reference = load_prompt_audio(wav)
    decoded = load_prompt_audio(convert(wav, tmp_path, suffix))
    assert decoded.sample_rate == (48_000 if suffix == "webm" else 16_000)  # Opus decodes at 48 kHz
    samples = at_16k(decoded)
    assert len(samples) == len(reference.samples)  # the container's duration cuts AAC's padding
    assert snr_db(reference.samples, samples) >= MIN_SNR_DB[suffix]


def test_the_bytes_of_an_m4a_upload_decode_like_its_file(tmp_path):
    path = convert(AISHELL[0], tmp_path, "m4a")
    from_bytes, from_file = load_prompt_audio(path.read_bytes()), load_prompt_audio(path)
    np.testing.assert_array_equal(from_bytes.samples, from_file.samples)


def test_a_3gp_amr_recording_is_refused_for_its_8_khz_rate(tmp_path):
    target = tmp_path / "phone.3gp"
    ffmpeg(AISHELL[0], target, "-ar", "8000", "-c:a", "libopencore_amrnb", "-b:a", "12.2k")
    with pytest.raises(SampleRateTooLowError, match="The recording's sample rate is 8000 Hz"):
        load_prompt_audio(target)


def test_an_m4a_cut_short_is_unreadable_with_the_formats_named(tmp_path):
    whole = convert(AISHELL[0], tmp_path, "m4a")
    cut = tmp_path / "cut.m4a"
    cut.write_bytes(whole.read_bytes()[:2000])
    message = r"Could not read cut.m4a as audio.*M4A/AAC, MP4, WebM/Opus"
    with pytest.raises(UnreadableAudioError, match=message):
        load_prompt_audio(cut)


def test_a_video_without_sound_is_unreadable(tmp_path):
    video = tmp_path / "silent-film.mp4"
    black = ["-f", "lavfi", "-i", "color=c=black:s=64x64:d=2", "-c:v", "mpeg4"]
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y", *black, str(video)], check=True)
    with pytest.raises(UnreadableAudioError, match="the file has no audio track"):
        load_prompt_audio(video)


def test_an_opus_file_longer_than_the_limit_is_refused_by_its_declared_length(tmp_path):
    long_wav = tmp_path / "long.wav"
    ffmpeg(AISHELL[0], long_wav, "-af", "aloop=loop=9:size=2e6")  # 10 x 4.2 s = 42 s
    with pytest.raises(AudioTooLongError, match=r"The recording is too long \(42\.0 s\)"):
        load_prompt_audio(convert(long_wav, tmp_path, "webm"))


def with_silence(audio: PromptAudio, before_s: float, after_s: float) -> PromptAudio:
    rate = audio.sample_rate
    zeros = [np.zeros(int(s * rate), np.float32) for s in (before_s, after_s)]
    return PromptAudio(np.concatenate([zeros[0], audio.samples, zeros[1]]), rate)


@pytest.mark.parametrize("wav", [*AISHELL, ASSETS_VOICES / "en-espeak-us.wav"], ids=lambda p: p.stem)
def test_trimming_removes_added_silence(wav):
    audio = load_prompt_audio(wav)
    alone = prepare_prompt(audio)
    padded = prepare_prompt(with_silence(audio, 1.5, 2.0))
    assert padded.original_seconds == pytest.approx(audio.seconds + 3.5, abs=1e-3)
    assert padded.audio.seconds == pytest.approx(alone.audio.seconds, abs=0.15)
    assert padded.start_s >= 1.5 - PAD_S - HOP_S
    assert padded.end_s <= 1.5 + audio.seconds + PAD_S + FRAME_S + HOP_S
    assert "silence trimmed" in padded.summary()


def test_trimming_keeps_pad_s_before_the_first_speech():
    rate = 16_000
    tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(2 * rate) / rate).astype(np.float32)
    prepared = prepare_prompt(with_silence(PromptAudio(tone, rate), 1.0, 1.0))
    assert prepared.start_s == pytest.approx(1.0 - PAD_S, abs=0.011)
    assert prepared.audio.seconds == pytest.approx(2.0 + 2 * PAD_S + FRAME_S, abs=2 * HOP_S)


def test_a_long_recording_keeps_its_best_part_between_pauses():
    audio = load_prompt_audio(AISHELL[0])
    rate = audio.sample_rate
    gap = np.zeros(rate // 2, np.float32)
    long = PromptAudio(np.concatenate([audio.samples, gap] * 8), rate)  # 37.6 s
    prepared = prepare_prompt(long)
    assert prepared.cut and "best part of a long recording" in prepared.summary()
    assert MAX_SECONDS - 3 < prepared.audio.seconds <= MAX_SECONDS
    # It starts and ends in a pause, not inside a word: no speech in the recording's frames at its edges.
    speech = speech_frames(frame_levels(long.samples, rate))
    first, last = round(prepared.start_s / HOP_S), round(prepared.end_s / HOP_S) - 2
    assert not speech[first] and not speech[last]
    assert speech[first : last + 1].mean() > 0.5


def test_a_quiet_recording_is_brought_to_the_target_level():
    audio = load_prompt_audio(ASSETS_VOICES / "en-espeak-us.wav")
    quiet = PromptAudio(audio.samples * np.float32(0.05), audio.sample_rate)
    prepared = prepare_prompt(quiet)
    assert prepared.gain_db == pytest.approx(prepare_prompt(audio).gain_db + 26.0, abs=0.1)
    assert float(np.abs(prepared.audio.samples).max()) <= MAX_PEAK + 1e-6


def test_a_loud_recording_is_lowered_to_the_target_level():
    rate = 16_000
    square = np.sign(np.sin(2 * np.pi * 200 * np.arange(3 * rate) / rate)).astype(np.float32) * 0.99
    prepared = prepare_prompt(PromptAudio(square, rate))
    rms_dbfs = 20 * np.log10(np.sqrt(np.mean(prepared.audio.samples.astype(np.float64) ** 2)))
    assert rms_dbfs == pytest.approx(TARGET_DBFS, abs=0.1)


def test_a_click_in_a_quiet_recording_keeps_the_peak_at_the_limit():
    audio = load_prompt_audio(AISHELL[0])  # speech at about -39 dBFS RMS
    samples = audio.samples.copy()
    samples[len(samples) // 2] = 0.5
    prepared = prepare_prompt(PromptAudio(samples, audio.sample_rate))
    assert float(np.abs(prepared.audio.samples).max()) == pytest.approx(MAX_PEAK, abs=1e-6)
    assert prepared.gain_db == pytest.approx(20 * np.log10(MAX_PEAK / 0.5), abs=0.01)


def test_too_little_speech_once_trimmed_is_too_short():
    rate = 16_000
    blip = 0.3 * np.sin(2 * np.pi * 220 * np.arange(rate // 2) / rate).astype(np.float32)
    with pytest.raises(AudioTooShortError, match=r"only 0\.9\d s of speech once the silence around it"):
        prepare_prompt(with_silence(PromptAudio(blip, rate), 2.0, 2.0))


def test_an_upload_may_be_long_up_to_its_own_limit(tmp_path):
    import soundfile as sf

    audio = load_prompt_audio(AISHELL[1])
    path = tmp_path / "lecture.wav"
    sf.write(path, np.tile(audio.samples, 12), audio.sample_rate)  # 49 s
    assert read_upload(path, max_mb=20).cut
    sf.write(path, np.zeros(int((MAX_UPLOAD_SECONDS + 1) * 16_000), np.float32), 16_000)
    with pytest.raises(AudioTooLongError, match=f"may be at most {MAX_UPLOAD_SECONDS:g} s"):
        read_upload(path, max_mb=20)
