import io
import math
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import librosa
import numpy as np
import pytest
import soundfile as sf
import torch

from cosyapp.frontend.audio import (
    MAX_PROMPT_SECONDS,
    MIN_PROMPT_SECONDS,
    AudioTooLongError,
    AudioTooShortError,
    EmptyAudioError,
    NonFiniteAudioError,
    SampleRateTooLowError,
    SilentAudioError,
    UnreadableAudioError,
    VoiceError,
    load_prompt_audio,
)
from cosyapp.frontend.voice import (
    VoiceFeatures,
    VoiceFrontend,
    kaldi_fbank_cmn,
    prompt_mel,
    resample,
    whisper_log_mel,
)
from cosyapp.models.cosyvoice2 import PromptInputs

PROMPT_FORMATS = ("WAV", "FLAC", "OGG", "MP3")


def _s3tokenizer():
    """The s3tokenizer package: reference whisper features and two real AISHELL-1 recordings."""
    try:
        import s3tokenizer
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("s3tokenizer is not installed (required under CI=true)")
        pytest.skip("s3tokenizer is not installed (pip install s3tokenizer)")
    return s3tokenizer


@pytest.fixture(scope="module")
def aishell_wav() -> Path:
    """A real 16 kHz Mandarin recording (AISHELL-1, Apache-2.0) shipped with s3tokenizer."""
    return Path(str(resources.files(_s3tokenizer()) / "assets" / "BAC009S0764W0121.wav"))


@pytest.fixture(scope="module")
def frontend(tiny_model_dir) -> VoiceFrontend:
    return VoiceFrontend(tiny_model_dir)


def voiced(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A speech-like signal: harmonics of a wavering 120-180 Hz pitch with syllable-rate envelope + noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 150 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    harmonics = sum(np.sin(k * phase) / k for k in range(1, 15))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)
    signal = 0.15 * envelope * harmonics + 0.01 * rng.standard_normal(len(t))
    return signal.astype(np.float32)


def write(path: Path, samples: np.ndarray, rate: int, **kwargs) -> Path:
    sf.write(path, samples, rate, **kwargs)
    return path


# --- real recording through the tiny model's ONNX files ---


def test_real_recording_gives_p_tokens_and_2p_mel_frames(frontend, aishell_wav):
    audio = load_prompt_audio(aishell_wav)
    wave = torch.from_numpy(audio.samples)
    raw_tokens = len(frontend.speech_tokens(resample(wave, audio.sample_rate, 16_000)))
    mel_frames = len(prompt_mel(resample(wave, audio.sample_rate, 24_000)))

    features = frontend.features(audio)

    p = min(mel_frames // 2, raw_tokens)
    assert p > 50
    assert features.speech_tokens.shape == (p,) and features.speech_tokens.dtype == torch.long
    assert features.speech_feat.shape == (2 * p, 80) and features.speech_feat.dtype == torch.float32
    assert torch.isfinite(features.speech_feat).all()
    assert ((features.speech_tokens >= 0) & (features.speech_tokens <= 6560)).all()


def test_real_recording_gives_a_finite_192_dim_embedding(frontend, aishell_wav):
    embedding = frontend.features(load_prompt_audio(aishell_wav)).embedding

    assert embedding.shape == (192,) and embedding.dtype == torch.float32
    assert torch.isfinite(embedding).all()
    assert embedding.abs().sum() > 0


def test_same_file_twice_gives_identical_features(frontend, aishell_wav):
    first = frontend.features(load_prompt_audio(aishell_wav))
    second = frontend.features(load_prompt_audio(aishell_wav.read_bytes()))

    assert torch.equal(first.speech_tokens, second.speech_tokens)
    assert torch.equal(first.speech_feat, second.speech_feat)
    assert torch.equal(first.embedding, second.embedding)


def test_prompt_from_features_conditions_the_tiny_flow(frontend, tiny_model, aishell_wav):
    features = frontend.features(load_prompt_audio(aishell_wav))
    prompt = features.prompt([11, 12, 13])

    assert isinstance(prompt, PromptInputs)
    assert prompt.text_ids.tolist() == [11, 12, 13] and prompt.text_ids.dtype == torch.long
    assert tiny_model.tokens_to_mel(features.speech_tokens[:9], prompt).shape == (80, 18)


def test_features_survive_a_save_and_load(frontend, aishell_wav, tmp_path):
    features = frontend.features(load_prompt_audio(aishell_wav))
    features.save(tmp_path / "voice.safetensors")

    loaded = VoiceFeatures.load(tmp_path / "voice.safetensors")

    assert torch.equal(loaded.speech_tokens, features.speech_tokens)
    assert torch.equal(loaded.speech_feat, features.speech_feat)
    assert torch.equal(loaded.embedding, features.embedding)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["voice.safetensors"]


def test_loading_features_rejects_other_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3)}, str(tmp_path / "other.safetensors"))
    (tmp_path / "junk.bin").write_bytes(b"not a tensor file at all")

    with pytest.raises(ValueError, match="holds no voice features"):
        VoiceFeatures.load(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not a safetensors file"):
        VoiceFeatures.load(tmp_path / "junk.bin")


def test_voice_module_imports_without_onnxruntime():
    code = "import sys, cosyapp.frontend.voice; print('onnxruntime' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# --- feature functions against references ---


def test_resample_is_torchaudios_resample_transform_at_its_defaults():
    import torchaudio

    wave = torch.from_numpy(voiced(1.0, 44_100))

    expected = torchaudio.transforms.Resample(44_100, 24_000)(wave)

    assert torch.equal(resample(wave, 44_100, 24_000), expected)
    assert resample(wave, 16_000, 16_000) is wave


def test_whisper_log_mel_matches_s3tokenizer(aishell_wav):
    samples, rate = sf.read(aishell_wav, dtype="float32")
    assert rate == 16_000
    wave = torch.from_numpy(samples)

    reference = _s3tokenizer().log_mel_spectrogram(wave, n_mels=128)

    ours = whisper_log_mel(wave)
    assert ours.shape == (1, 128, len(samples) // 160) == (1, *reference.shape)
    torch.testing.assert_close(ours[0], reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [16_000, 16_159, 16_160, 33_333])
def test_whisper_log_mel_has_one_frame_per_160_samples(n):
    assert whisper_log_mel(torch.from_numpy(voiced(n / 16_000, 16_000))).shape == (1, 128, n // 160)


@pytest.mark.parametrize("n", [16_000, 16_399, 16_400, 33_333])
def test_kaldi_fbank_frame_count_follows_snip_edges(n):
    feats = kaldi_fbank_cmn(torch.from_numpy(voiced(n / 16_000, 16_000)))
    assert feats.shape == (1 + (n - 400) // 160, 80)


def test_kaldi_fbank_is_mean_normalised_per_bin():
    feats = kaldi_fbank_cmn(torch.from_numpy(voiced(2.0, 16_000)))

    assert feats.abs().max() > 1.0
    torch.testing.assert_close(feats.mean(dim=0), torch.zeros(80), atol=1e-4, rtol=0)


@pytest.mark.parametrize("n", [24_000, 24_479, 24_480, 50_001])
def test_prompt_mel_has_one_frame_per_480_samples(n):
    assert prompt_mel(torch.from_numpy(voiced(n / 24_000, 24_000))).shape == (n // 480, 80)


def test_prompt_mel_matches_a_numpy_reference():
    wave = voiced(1.5, 24_000)
    padded = np.pad(wave.astype(np.float64), 720, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, 1920)[::480]
    periodic_hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(1920) / 1920)
    spec = np.fft.rfft(frames * periodic_hann, axis=1).T
    magnitude = np.sqrt(np.abs(spec) ** 2 + 1e-9)
    mel = librosa.filters.mel(sr=24_000, n_fft=1920, n_mels=80, fmin=0, fmax=8000) @ magnitude
    reference = np.log(np.maximum(mel, 1e-5)).T

    ours = prompt_mel(torch.from_numpy(wave)).numpy()
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=1e-3)


def test_pure_tone_energy_lands_in_its_mel_band():
    t = np.arange(24_000) / 24_000
    tone = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    centres = librosa.mel_frequencies(n_mels=82, fmin=0, fmax=8000)[1:-1]

    band_energy = prompt_mel(torch.from_numpy(tone)).mean(dim=0)

    assert int(band_energy.argmax()) == int(np.abs(centres - 1000).argmin())
    assert band_energy.max() - band_energy[60:].max() > 5  # 3.6 kHz and up hold almost nothing


# --- loading: formats, channels, rates, Gradio tuples ---


def test_this_soundfile_supports_every_prompt_format():
    assert set(PROMPT_FORMATS) <= set(sf.available_formats())


@pytest.mark.parametrize("fmt", PROMPT_FORMATS)
def test_each_prompt_format_loads_and_gives_features(fmt, frontend, tmp_path):
    original = voiced(2.0, 24_000)
    path = write(tmp_path / f"voice.{fmt.lower()}", original, 24_000, format=fmt)

    audio = load_prompt_audio(path)

    assert audio.sample_rate == 24_000 and audio.samples.dtype == np.float32
    assert audio.seconds == pytest.approx(2.0, abs=0.1)
    assert 0.1 < np.abs(audio.samples).max() <= 1.0
    assert len(frontend.features(audio).speech_tokens) == 50


def test_wav_bytes_load_like_the_file(tmp_path):
    path = write(tmp_path / "voice.wav", voiced(1.5, 16_000), 16_000)

    from_bytes = load_prompt_audio(path.read_bytes())

    np.testing.assert_array_equal(from_bytes.samples, load_prompt_audio(path).samples)


def test_stereo_file_is_mixed_to_mono_by_averaging(tmp_path):
    left, right = voiced(1.5, 44_100, seed=1), voiced(1.5, 44_100, seed=2)
    path = write(tmp_path / "stereo.wav", np.stack([left, right], axis=1), 44_100, subtype="FLOAT")

    audio = load_prompt_audio(path)

    assert audio.sample_rate == 44_100 and audio.samples.shape == (len(left),)
    np.testing.assert_allclose(audio.samples, (left + right) / 2, atol=1e-7)


def test_44k_recording_is_resampled_for_each_feature(frontend, tmp_path):
    n = 66_150  # 1.5 s at 44.1 kHz
    path = write(tmp_path / "stereo.wav", np.stack([voiced(1.5, 44_100)] * 2, axis=1), 44_100)

    features = frontend.features(load_prompt_audio(path))

    n16, n24 = math.ceil(n * 16_000 / 44_100), math.ceil(n * 24_000 / 44_100)
    raw_tokens = math.ceil(math.ceil((n16 // 160) / 2) / 2)  # the tiny tokenizer's two stride-2 convs
    p = min((n24 // 480) // 2, raw_tokens)
    assert features.speech_tokens.shape == (p,) and features.speech_feat.shape == (2 * p, 80)


def test_gradio_int16_tuple_is_scaled_to_unit_range():
    pcm = (voiced(1.5, 22_050) * 32_767).astype(np.int16)

    audio = load_prompt_audio((22_050, pcm))

    assert audio.sample_rate == 22_050 and audio.samples.dtype == np.float32
    np.testing.assert_allclose(audio.samples, pcm / 32_768, atol=1e-7)


def test_gradio_stereo_float_tuple_is_averaged():
    stereo = np.stack([voiced(1.5, 48_000, seed=1), voiced(1.5, 48_000, seed=2)], axis=1)

    audio = load_prompt_audio((48_000, stereo))

    np.testing.assert_allclose(audio.samples, stereo.mean(axis=1), atol=1e-7)


@pytest.mark.parametrize("seconds", [MIN_PROMPT_SECONDS, MAX_PROMPT_SECONDS])
def test_lengths_at_the_limits_are_accepted(seconds, tmp_path):
    path = write(tmp_path / "edge.wav", voiced(seconds, 16_000), 16_000)
    assert load_prompt_audio(path).seconds == seconds


# --- every invalid recording has its own error ---


def test_every_voice_error_is_a_value_error():
    errors = [
        UnreadableAudioError,
        EmptyAudioError,
        AudioTooShortError,
        AudioTooLongError,
        SampleRateTooLowError,
        SilentAudioError,
        NonFiniteAudioError,
    ]
    assert all(issubclass(e, VoiceError) and issubclass(e, ValueError) for e in errors)
    assert len(set(errors)) == 7


def test_corrupt_bytes_are_unreadable():
    with pytest.raises(UnreadableAudioError, match="Could not read the uploaded file as audio"):
        load_prompt_audio(b"RIFF\x00\x00not really a wave file" * 10)


def test_truncated_wav_file_is_unreadable(tmp_path):
    whole = io.BytesIO()
    sf.write(whole, voiced(2.0, 16_000), 16_000, format="WAV")
    path = tmp_path / "cut.wav"
    path.write_bytes(whole.getvalue()[:30])

    with pytest.raises(UnreadableAudioError, match="cut.wav.*corrupt or not in a format"):
        load_prompt_audio(path)


def test_zero_byte_file_is_empty(tmp_path):
    (tmp_path / "empty.wav").write_bytes(b"")
    with pytest.raises(EmptyAudioError, match="empty: the file has no content"):
        load_prompt_audio(tmp_path / "empty.wav")


def test_wav_without_samples_is_empty(tmp_path):
    path = write(tmp_path / "none.wav", np.zeros(0, dtype=np.float32), 16_000)
    with pytest.raises(EmptyAudioError, match="contains no samples"):
        load_prompt_audio(path)


def test_half_second_clip_is_too_short(tmp_path):
    path = write(tmp_path / "short.wav", voiced(0.5, 16_000), 16_000)
    with pytest.raises(AudioTooShortError, match=r"too short \(0\.50 s\).*at least 1 s"):
        load_prompt_audio(path)


def test_31_second_clip_is_too_long(tmp_path):
    path = write(tmp_path / "long.flac", voiced(31.0, 16_000), 16_000)
    with pytest.raises(AudioTooLongError, match=r"too long \(31\.0 s\).*at most 30 s"):
        load_prompt_audio(path)


def test_8k_file_has_too_low_a_sample_rate(tmp_path):
    path = write(tmp_path / "phone.wav", voiced(2.0, 8_000), 8_000)
    with pytest.raises(SampleRateTooLowError, match="8000 Hz.*at least 16 kHz"):
        load_prompt_audio(path)


def test_all_zero_audio_is_silent(tmp_path):
    path = write(tmp_path / "zeros.wav", np.zeros(32_000, dtype=np.float32), 16_000)
    with pytest.raises(SilentAudioError, match=r"silent \(peak level below -60 dBFS\)"):
        load_prompt_audio(path)


def test_nan_samples_are_rejected(tmp_path):
    samples = voiced(2.0, 16_000)
    samples[1000:1010] = np.nan
    path = write(tmp_path / "nan.wav", samples, 16_000, subtype="FLOAT")
    with pytest.raises(NonFiniteAudioError, match="NaN or infinite"):
        load_prompt_audio(path)
