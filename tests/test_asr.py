"""Prompt transcription: the tiny random-weight Whisper in the hub's layout, written here, through
the loader real models take; lazy loading, batching, demo fallback and the offline message."""

import threading
import time

import huggingface_hub.constants
import numpy as np
import pytest

from cosyapp.asr import LANGUAGES, Transcriber, TranscriptionUnavailableError
from cosyapp.asr.transcriber import TINY_FOLDER, available
from cosyapp.frontend.audio import PromptAudio, load_prompt_audio
from cosyapp.frontend.voice_rules import check_prompt_text
from cosyapp.frontend.voices import ASSETS_VOICES
from cosyapp.modelgen.tiny_asr import write_tiny_asr_model
from cosyapp.settings import DEFAULT_ASR_REPO

REPO_ID = "cosyapp-test/tiny-whisper"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
AISHELL = ASSETS_VOICES / "zh-aishell-w0121.wav"
ENGLISH = ASSETS_VOICES / "en-espeak-us.wav"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A hub cache holding REPO_ID as ``huggingface_hub`` lays a download out: snapshots/<commit>/
    with the files, refs/main naming the commit."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    write_tiny_asr_model(repo / "snapshots" / COMMIT, seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    """The hub client reads this cache and never the network."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


@pytest.fixture(scope="module")
def shared(hub_cache, tmp_path_factory):
    """One transcriber over the tiny model's folder, shared by the tests that only transcribe."""
    folder = hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    return Transcriber(str(folder), "cpu", tmp_path_factory.mktemp("cache"))


def test_the_model_loads_from_a_hub_repo_in_the_cache(offline_hub, tmp_path):
    transcriber = Transcriber(REPO_ID, "cpu", tmp_path)
    transcript = transcriber.transcribe(load_prompt_audio(AISHELL))
    assert transcript.language in LANGUAGES
    assert transcript.text and set(transcript.text) <= set(" abcdefghijklmnopqrstuvwxyz")
    assert not transcript.demo  # a model named explicitly is a real one, whatever its weights
    assert not (tmp_path / TINY_FOLDER).exists()


def test_a_folder_path_loads_the_same_model(shared, offline_hub, tmp_path):
    audio = load_prompt_audio(AISHELL)
    from_repo = Transcriber(REPO_ID, "cpu", tmp_path).transcribe(audio)
    assert shared.transcribe(audio) == from_repo


def test_a_missing_model_offline_gives_a_clear_message_every_time(offline_hub, tmp_path):
    transcriber = Transcriber("cosyapp-test/not-there", "cpu", tmp_path)  # lazy: nothing loads yet
    audio = load_prompt_audio(AISHELL)
    for _ in range(2):
        with pytest.raises(TranscriptionUnavailableError) as error:
            transcriber.transcribe(audio)
        assert error.value.message.startswith(
            "Automatic transcription is unavailable: the ASR model cosyapp-test/not-there is not cached "
            "and could not be downloaded"
        )
        assert "--asr-model FOLDER" in error.value.message
        assert error.value.message.endswith("Type what is said in the recording.")


def test_a_folder_without_a_model_gives_a_clear_message(tmp_path):
    with pytest.raises(
        TranscriptionUnavailableError, match="holds no config.json: it is not a Whisper model"
    ):
        Transcriber(str(tmp_path), "cpu", tmp_path).transcribe(load_prompt_audio(AISHELL))


def test_the_default_model_offline_falls_back_to_the_marked_demo_model(offline_hub, tmp_path):
    transcript = Transcriber(DEFAULT_ASR_REPO, "cpu", tmp_path).transcribe(load_prompt_audio(AISHELL))
    assert transcript.demo and transcript.text
    assert (tmp_path / TINY_FOLDER / "model.safetensors").is_file()


def test_demo_mode_uses_the_demo_model_without_asking_the_hub(tmp_path):
    transcript = Transcriber("cosyapp-test/never-asked", "cpu", tmp_path, demo=True).transcribe(
        load_prompt_audio(ENGLISH)
    )
    assert transcript.demo and transcript.language in LANGUAGES


def test_no_asr_says_that_transcription_is_off():
    with pytest.raises(TranscriptionUnavailableError, match="Automatic transcription is off on this server"):
        available(None)


@pytest.mark.parametrize("seconds", [1.0, 4.2, 15.0])
def test_a_demo_transcript_passes_the_transcript_checks(shared, seconds):
    audio = load_prompt_audio(AISHELL)
    clip = PromptAudio(np.resize(audio.samples, int(seconds * audio.sample_rate)), audio.sample_rate)
    assert check_prompt_text(shared.transcribe(clip).text, clip)


def test_a_given_language_skips_detection(shared):
    audio = load_prompt_audio(ENGLISH)
    detected = shared.transcribe(audio).language
    other = next(code for code in LANGUAGES if code != detected)
    assert shared.transcribe(audio, language=other).language == other


def test_uploads_that_arrive_together_are_transcribed_in_one_batch(shared):
    long = load_prompt_audio(AISHELL)
    busy = PromptAudio(np.resize(long.samples, 30 * long.sample_rate), long.sample_rate)
    clips = [load_prompt_audio(path) for path in (AISHELL, ENGLISH, ASSETS_VOICES / "en-espeak-gb.wav")]
    alone = [shared.transcribe(clip) for clip in clips]
    running = shared.submit(busy)  # keeps the ASR thread busy while the three arrive
    while not running.running():
        time.sleep(0.001)
    futures = [shared.submit(clip) for clip in clips]
    together = [future.result() for future in futures]
    running.result()
    assert shared.batches[-1] == len(clips)
    assert together == alone  # a batch gives each recording its own transcript


def test_transcribe_async_waits_off_the_event_loop(shared):
    import asyncio

    audio = load_prompt_audio(ENGLISH)
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    async def main():
        ticker = asyncio.create_task(tick())
        transcript = await shared.transcribe_async(audio)
        ticker.cancel()
        return transcript

    transcript = asyncio.run(main())
    assert transcript == shared.transcribe(audio)
    assert ticks > 1  # the loop kept running while the ASR thread worked
    assert threading.current_thread() is threading.main_thread()


def test_the_flags_choose_the_model_or_turn_transcription_off(monkeypatch):
    from cosyapp.settings import parse_settings

    assert parse_settings([]).asr_model == DEFAULT_ASR_REPO
    assert parse_settings(["--asr-model", "/models/whisper"]).asr_model == "/models/whisper"
    assert parse_settings(["--no-asr"]).asr_model is None
    monkeypatch.setenv("COSYAPP_NO_ASR", "1")
    assert parse_settings([]).asr_model is None
