import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyapp.frontend.audio import AudioTooShortError, load_prompt_audio
from cosyapp.frontend.voice import VoiceFrontend
from cosyapp.frontend.voice_rules import sanitize_name
from cosyapp.frontend.voices import ASSETS_VOICES, VoiceLibrary, VoiceNotFoundError

AISHELL = ASSETS_VOICES / "zh-aishell-w0121.wav"
AISHELL_TEXT = "甚至出现交易几乎停滞的情况"


@pytest.fixture(scope="module")
def frontend(tiny_model_dir):
    return VoiceFrontend(tiny_model_dir)


@pytest.fixture
def library(tmp_path, frontend):
    return VoiceLibrary(tmp_path / "data", frontend)


def test_builtin_voices_are_listed_with_language_and_source(library):
    voices = {v.id: v for v in library.list_voices()}
    assert set(voices) == {"zh-aishell-w0121", "zh-aishell-w0122", "en-espeak-us", "en-espeak-gb"}
    assert voices["zh-aishell-w0121"].language == "zh" and "AISHELL-1" in voices["zh-aishell-w0121"].note
    assert "synthetic" in voices["en-espeak-us"].note and voices["en-espeak-us"].kind == "builtin"


def test_builtin_voice_has_aligned_features_and_its_transcript(library):
    voice = library.get("zh-aishell-w0121")
    p = len(voice.features.speech_tokens)
    assert voice.prompt_text == AISHELL_TEXT
    assert p > 50 and voice.features.speech_feat.shape == (2 * p, 80)


def test_same_recording_is_featurised_once_even_after_a_restart(tmp_path, frontend):
    library = VoiceLibrary(tmp_path / "data", frontend)
    first = library.get("zh-aishell-w0121")
    library.get("zh-aishell-w0121")
    library.save("mine", AISHELL.read_bytes(), AISHELL_TEXT, session="a")  # same audio, new voice
    assert library.features_computed == 1
    restarted = VoiceLibrary(tmp_path / "data", frontend)
    again = restarted.get("zh-aishell-w0121")
    assert restarted.features_computed == 0
    assert torch.equal(again.features.speech_tokens, first.features.speech_tokens)


def test_the_feature_cache_keeps_the_most_recent_recordings_and_every_saved_voice(tmp_path, frontend):
    library = VoiceLibrary(tmp_path / "data", frontend, max_cached_features=2)
    saved = library.save("kept", str(AISHELL), AISHELL_TEXT, session="a")
    names = {"w0122": "zh-aishell-w0122", "us": "en-espeak-us", "gb": "en-espeak-gb"}
    recordings = {key: load_prompt_audio(ASSETS_VOICES / f"{name}.wav") for key, name in names.items()}
    for audio in recordings.values():
        library.features_of(audio)
    cached = {p.stem for p in library.features_dir.glob("*.safetensors")}
    assert len(cached) == 2  # the saved voice's features and the latest recording's
    assert library.get(saved.id, "a").prompt_text == AISHELL_TEXT
    computed = library.features_computed
    library.features_of(recordings["gb"])  # still cached
    library.features_of(recordings["w0122"])  # evicted: computed again
    assert library.features_computed == computed + 1


def test_a_builtin_voice_is_made_once_and_then_served_from_memory(library):
    first = library.get("en-espeak-us")
    for path in library.features_dir.glob("*.safetensors"):
        path.unlink()  # the next request reads neither the recording nor its features
    assert library.get("en-espeak-us") is first and library.features_computed == 1


def test_private_voice_is_visible_only_to_its_session_and_survives_restart(tmp_path, frontend):
    library = VoiceLibrary(tmp_path / "data", frontend)
    info = library.save("Alice", str(AISHELL), AISHELL_TEXT, session="session-a")
    assert info.id in {v.id for v in library.list_voices("session-a")}
    assert info.id not in {v.id for v in library.list_voices("session-b")}
    with pytest.raises(VoiceNotFoundError):
        library.get(info.id, "session-b")
    restarted = VoiceLibrary(tmp_path / "data", frontend)
    voice = restarted.get(info.id, "session-a")
    assert voice.info.name == "Alice" and voice.prompt_text == AISHELL_TEXT


def test_shared_voice_is_visible_to_every_session(library):
    info = library.save("Team voice", str(AISHELL), AISHELL_TEXT, session="a", shared=True)
    assert info.id in {v.id for v in library.list_voices("b")} and info.id in {
        v.id for v in library.list_voices(None)
    }
    assert library.get(info.id, "b").info.shared


def test_only_the_owner_deletes_a_private_voice(library):
    info = library.save("Temp", str(AISHELL), AISHELL_TEXT, session="a")
    with pytest.raises(VoiceNotFoundError):
        library.delete(info.id, "b")
    library.delete(info.id, "a")
    assert info.id not in {v.id for v in library.list_voices("a")}


@pytest.mark.parametrize(
    ("transcript", "language"),
    [
        (AISHELL_TEXT, "zh"),
        ("Even trading came almost to a standstill there", "en"),
        ("거래가 거의 멈추는 상황까지 나타났다", "ko"),
        ("取引がほとんど止まる状況さえ現れた", "ja"),  # kanji and kana: Japanese
    ],
)
def test_a_voice_saved_without_a_language_takes_its_transcripts(tmp_path, frontend, transcript, language):
    library = VoiceLibrary(tmp_path / "data", frontend)
    info = library.save("Page voice", str(AISHELL), transcript, session="a")
    assert info.language == language
    assert VoiceLibrary(tmp_path / "data", frontend).get(info.id, "a").info.language == language  # kept
    heard = library.save("Heard voice", str(AISHELL), AISHELL_TEXT, session="a", language="yue")
    assert heard.language == "yue"  # a recogniser's language wins over the script


def test_voice_names_are_sanitised():
    assert sanitize_name("  ../../etc/passwd\n<b>Bob</b>\t ") == "....etcpasswd bBobb"
    assert sanitize_name("Zoë  ​ 小明") == "Zoë 小明"
    assert len(sanitize_name("x" * 500)) == 60
    with pytest.raises(ValueError, match="name"):
        sanitize_name("\n\t ")


def test_saving_rejects_an_unusable_recording_or_transcript(library, tmp_path):
    short = tmp_path / "short.wav"
    sf.write(short, 0.3 * torch.randn(8000).numpy(), 16000)
    with pytest.raises(AudioTooShortError):
        library.save("x", str(short), "hello", session="a")
    with pytest.raises(ValueError, match="transcript"):
        library.save("x", str(AISHELL), "   ", session="a")


def test_unknown_or_malformed_ids_are_not_found(library):
    for voice_id in ["user-000000000000", "../../etc", "user-../x"]:
        with pytest.raises(VoiceNotFoundError):
            library.get(voice_id, "a")


def test_zero_shot_speakers_of_spk2info_are_offered(tmp_path, frontend, library):
    features = library.get("zh-aishell-w0122").features
    p = len(features.speech_tokens)
    spk2info = {
        "narrator": {
            "prompt_text": torch.tensor([[5, 6, 7]], dtype=torch.int32),
            "llm_prompt_speech_token": features.speech_tokens[None].int(),
            "flow_prompt_speech_token": features.speech_tokens[None].int(),
            "prompt_speech_feat": features.speech_feat[None],
            "llm_embedding": features.embedding[None],
            "flow_embedding": features.embedding[None],
        },
        "sft-only": {"embedding": torch.zeros(1, 192)},
    }
    path = tmp_path / "spk2info.pt"
    torch.save(spk2info, path)
    lib = VoiceLibrary(tmp_path / "d2", frontend, spk2info=path)
    model_voices = [v for v in lib.list_voices() if v.kind == "model"]
    assert [v.id for v in model_voices] == ["model-narrator"]
    voice = lib.get("model-narrator")
    assert voice.prompt_ids == (5, 6, 7) and len(voice.features.speech_tokens) == p


def test_builtin_assets_carry_a_licence_note():
    import json

    metas = sorted(Path(ASSETS_VOICES).glob("*.json"))
    assert len(metas) == 4
    for meta_path in metas:
        meta = json.loads(meta_path.read_text())
        assert meta["licence"] and meta["transcript"] and (ASSETS_VOICES / meta["audio"]).is_file()


def _long_recording(seconds: float = 28.0) -> bytes:
    """A WAV of a built-in recording repeated to ``seconds`` (the longest prompts take the longest)."""
    wave, rate = sf.read(ASSETS_VOICES / "zh-aishell-w0122.wav")
    buffer = io.BytesIO()
    sf.write(buffer, np.tile(wave, int(seconds * rate / len(wave))), rate, format="WAV")
    return buffer.getvalue()


def _while_extracting(library: VoiceLibrary, upload) -> threading.Thread:
    """Start ``upload`` in a thread and return once its feature extraction is under way."""
    thread = threading.Thread(target=upload)
    thread.start()
    while not library._computing:
        assert thread.is_alive(), "the upload ended before its extraction was seen"
        time.sleep(0.0005)
    return thread


def test_a_voice_upload_does_not_delay_the_lookup_of_a_cached_voice(library):
    library.get("zh-aishell-w0121")  # cached from now on
    upload = _while_extracting(library, lambda: library.save("long", _long_recording(), AISHELL_TEXT, "a"))
    started = time.perf_counter()
    voice = library.get("zh-aishell-w0121")
    lookup = time.perf_counter() - started
    still_extracting = bool(library._computing)
    upload.join()
    assert voice.prompt_text == AISHELL_TEXT
    assert still_extracting and lookup < 0.05, lookup
    assert library.features_computed == 2


def test_two_uploads_of_the_same_recording_run_the_frontend_once(library):
    recording = _long_recording()
    saved = []

    def upload(name):
        saved.append(library.save(name, recording, AISHELL_TEXT, session="a"))

    first = _while_extracting(library, lambda: upload("first"))
    second = threading.Thread(target=upload, args=("second",))
    second.start()
    first.join()
    second.join()
    assert library.features_computed == 1
    one, two = (library.get(info.id, "a").features for info in saved)
    assert {info.name for info in saved} == {"first", "second"}
    assert torch.equal(one.speech_tokens, two.speech_tokens) and torch.equal(one.embedding, two.embedding)
