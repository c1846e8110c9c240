"""Bad voice prompts: real bad files written here, read by load_prompt_audio and the voice library.

Each class gets its VoiceError subclass (or PromptTextError) with a message for the user, or a defined
result (multichannel audio is mixed to mono). The same files through the UI are in
tests/ui/test_ui_hardening.py; docs/hardening.md lists them all.
"""

import json

import numpy as np
import pytest
import soundfile as sf

from cosyapp.frontend.audio import (
    MAX_FILE_MB,
    AudioTooLongError,
    AudioTooShortError,
    EmptyAudioError,
    FileTooLargeError,
    NonFiniteAudioError,
    SampleRateTooLowError,
    SilentAudioError,
    UnreadableAudioError,
    load_prompt_audio,
)
from cosyapp.frontend.voice import VoiceFrontend
from cosyapp.frontend.voice_rules import PromptTextError, check_prompt_text
from cosyapp.frontend.voices import ASSETS_VOICES, VoiceLibrary

AISHELL = ASSETS_VOICES / "zh-aishell-w0121.wav"
AISHELL_TEXT = "甚至出现交易几乎停滞的情况"


def tone(seconds: float, rate: int = 16_000, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 220 * t).astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


@pytest.fixture(scope="module")
def library(tmp_path_factory, tiny_model_dir):
    return VoiceLibrary(tmp_path_factory.mktemp("voices") / "data", VoiceFrontend(tiny_model_dir))


def test_not_audio_is_unreadable(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("this is a text file, not audio\n" * 20)
    with pytest.raises(UnreadableAudioError, match="Could not read notes.wav as audio: it is corrupt"):
        load_prompt_audio(path)


def test_a_wav_cut_inside_its_header_is_unreadable(tmp_path):
    whole = tmp_path / "whole.wav"
    sf.write(whole, tone(2.0), 16_000)
    cut = tmp_path / "cut.wav"
    cut.write_bytes(whole.read_bytes()[:30])
    with pytest.raises(UnreadableAudioError, match="Could not read cut.wav as audio"):
        load_prompt_audio(cut)


def test_a_wav_cut_inside_its_data_keeps_what_is_there(tmp_path):
    whole = tmp_path / "whole.wav"
    sf.write(whole, tone(4.0), 16_000, subtype="PCM_16")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(whole.read_bytes()[: 44 + 2 * 16_000 * 2])  # header + 2 s of 16-bit samples
    assert load_prompt_audio(cut).seconds == pytest.approx(2.0, abs=0.01)


def test_zero_byte_file_is_empty(tmp_path):
    (tmp_path / "empty.wav").write_bytes(b"")
    with pytest.raises(EmptyAudioError, match="The recording is empty: the file has no content"):
        load_prompt_audio(tmp_path / "empty.wav")


@pytest.mark.parametrize("peak", [0.0, 5e-4])
def test_silence_and_near_silence_are_refused(tmp_path, peak):
    sf.write(tmp_path / "quiet.wav", tone(2.0) / 0.3 * peak, 16_000, subtype="FLOAT")
    with pytest.raises(SilentAudioError, match=r"The recording is silent \(peak level below -60 dBFS\)"):
        load_prompt_audio(tmp_path / "quiet.wav")


def test_too_short_and_too_long_recordings_are_refused(tmp_path):
    sf.write(tmp_path / "short.wav", tone(0.8), 16_000)
    sf.write(tmp_path / "long.wav", tone(31.0), 16_000)
    with pytest.raises(AudioTooShortError, match=r"too short \(0.80 s\).*at least 1 s"):
        load_prompt_audio(tmp_path / "short.wav")
    with pytest.raises(AudioTooLongError, match=r"too long \(31.0 s\).*at most 30 s"):
        load_prompt_audio(tmp_path / "long.wav")


@pytest.mark.parametrize("rate", [8_000, 11_025, 15_999])
def test_sample_rates_below_16k_are_refused(tmp_path, rate):
    sf.write(tmp_path / "low.wav", tone(2.0, rate), rate)
    with pytest.raises(
        SampleRateTooLowError, match=f"sample rate is {rate} Hz; a voice prompt needs at least 16 kHz"
    ):
        load_prompt_audio(tmp_path / "low.wav")


def test_six_channels_are_mixed_to_mono(tmp_path):
    channels = tone(2.0, channels=6) * np.array([1, 0, 0, 0, 0, 1], dtype=np.float32)
    sf.write(tmp_path / "surround.wav", channels, 16_000, subtype="FLOAT")
    audio = load_prompt_audio(tmp_path / "surround.wav")
    assert audio.samples.shape == (32_000,)
    np.testing.assert_allclose(audio.samples, tone(2.0) / 3, atol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_float_wav_with_nan_or_inf_is_refused(tmp_path, bad):
    samples = tone(2.0)
    samples[1000] = bad
    sf.write(tmp_path / "broken.wav", samples, 16_000, subtype="FLOAT")
    with pytest.raises(NonFiniteAudioError, match="some samples are not numbers"):
        load_prompt_audio(tmp_path / "broken.wav")


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.wav"
    with open(path, "wb") as f:  # sparse: size on paper, no content; reading it would find no audio
        f.truncate((MAX_FILE_MB + 1) * 2**20)
    with pytest.raises(
        FileTooLargeError, match=f"The file is too large \\(21.0 MB; the limit is {MAX_FILE_MB} MB\\)"
    ):
        load_prompt_audio(path)
    with pytest.raises(FileTooLargeError, match="the limit is 1 MB"):
        load_prompt_audio(b"\0" * (2**20 + 1), max_mb=1)


def test_the_size_limit_is_a_parameter(tmp_path):
    sf.write(tmp_path / "ok.wav", tone(20.0), 16_000)  # 640 KB
    assert load_prompt_audio(tmp_path / "ok.wav", max_mb=1).seconds == pytest.approx(20.0)
    with pytest.raises(FileTooLargeError):
        load_prompt_audio(tmp_path / "ok.wav", max_mb=0.5)


@pytest.mark.parametrize("text", ["", "   \n", "\x00\x1b"])
def test_a_missing_transcript_is_refused(text):
    with pytest.raises(PromptTextError, match="Type what is said in the recording"):
        check_prompt_text(text, load_prompt_audio(AISHELL))


def test_a_transcript_far_too_long_for_the_recording_is_refused():
    with pytest.raises(PromptTextError, match=r"too long for the recording \(about 13 syllables per second"):
        check_prompt_text(AISHELL_TEXT * 4 + "的", load_prompt_audio(AISHELL))  # 53 syllables in 4.2 s


def test_a_transcript_far_too_short_for_the_recording_is_refused(tmp_path):
    sf.write(tmp_path / "long.wav", tone(20.0), 16_000)
    with pytest.raises(PromptTextError, match=r"too short for the recording \(about 1 syllables in 20.0 s\)"):
        check_prompt_text("Hi", load_prompt_audio(tmp_path / "long.wav"))


def test_every_built_in_transcript_matches_its_recording():
    for meta_path in sorted(ASSETS_VOICES.glob("*.json")):
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        audio = load_prompt_audio(ASSETS_VOICES / meta["audio"])
        assert check_prompt_text(meta["transcript"], audio) == meta["transcript"]


def test_a_transcript_over_500_characters_is_refused(tmp_path):
    sf.write(tmp_path / "long.wav", tone(30.0), 16_000)
    with pytest.raises(PromptTextError, match="The transcript has 501 characters; at most 500"):
        check_prompt_text("a" * 501, load_prompt_audio(tmp_path / "long.wav"))


@pytest.mark.parametrize(
    "name, shown",
    [
        ("../../../etc/cron.d/x", "......etccron.dx"),
        ("..", ".."),
        ("C:\\Windows\\system32", "C:Windowssystem32"),
        ("\u202eevil\u202c name", "evil name"),
        ("Zoë 小明 🎙", "Zoë 小明 🎙"),
        ("n" * 5000, "n" * 60),
    ],
)
def test_odd_voice_names_are_only_display_names_stored_inside_the_voice_folder(library, name, shown):
    before = set(library.user_dir.parent.rglob("*"))
    info = library.save(name, str(AISHELL), AISHELL_TEXT, session="s")
    assert info.name == shown
    created = set(library.user_dir.parent.rglob("*")) - before
    assert created and all(
        p.is_relative_to(library.user_dir) or p.is_relative_to(library.features_dir) for p in created
    )
    assert {p.name for p in created if p.is_dir()} == {info.id}


def test_a_name_with_nothing_printable_is_refused(library):
    with pytest.raises(ValueError, match="Give the voice a name"):
        library.save("\u200b\n\t\x00", str(AISHELL), AISHELL_TEXT, session="s")


def test_deleting_by_a_path_like_id_removes_nothing(library):
    outside = library.user_dir.parent / "keep.txt"
    outside.write_text("keep")
    for voice_id in ["../keep.txt", "..", "user-../../keep"]:
        with pytest.raises(KeyError):
            library.delete(voice_id, "s")
    assert outside.read_text() == "keep"
