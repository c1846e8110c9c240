"""The UI's named endpoints through gradio_client, as API users and load generators call them."""

import base64
import io
import re
import time
from concurrent.futures import ThreadPoolExecutor

import imageio_ffmpeg
import numpy as np
import pytest
import soundfile as sf
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

SAMPLES = re.compile(r"\(([\d,]+) samples at ([\d,]+) Hz\)")
BATCH = re.compile(r"batch of \*\*(\d+)\*\*")


@pytest.fixture(scope="module")
def client(ui):
    return Client(ui.url, download_files=False, verbose=False)


def form(text="Hello world.", voice="en-espeak-us", recording=None, prompt_text="", speed=1.0, seed=0):
    return text, voice, recording, prompt_text, speed, seed, ""


def clip_of(ui, file_data: dict) -> np.ndarray:
    samples, rate = sf.read(io.BytesIO(ui.fetch(file_data["url"])), dtype="float32")
    assert rate == 24_000
    return samples


def reported_samples(stats: str) -> int:
    return int(SAMPLES.search(stats)[1].replace(",", ""))


def test_concurrent_whole_clips_are_served_in_gradio_batches_each_with_its_own_result(client, ui):
    seeds = [1, 1, 2, 2, 3, 3, 4, 4]
    with ThreadPoolExecutor(len(seeds)) as pool:
        jobs = list(pool.map(lambda seed: client.submit(*form(seed=seed), api_name="/speak_clip"), seeds))
    results = [job.result(timeout=120) for job in jobs]
    batches = [int(BATCH.search(stats)[1]) for _, stats, _ in results]
    clips = [clip_of(ui, file) for _, _, file in results]
    print(f"batch size seen by each of the 8 requests: {batches}")
    assert max(batches) > 1, batches
    assert ui.service.pipeline.metrics.snapshot()["clip_max_batch_size"] >= max(batches)
    for (_, stats, _), clip in zip(results, clips, strict=True):
        assert len(clip) == reported_samples(stats) > 0 and len(clip) % 480 == 0
    for i in range(0, len(seeds), 2):  # same seed, same audio (up to one step of 16-bit rounding)
        assert len(clips[i]) == len(clips[i + 1])
        assert np.abs(clips[i] - clips[i + 1]).max() <= 2 / 32768
    firsts = clips[::2]  # different seeds, different audio
    for a in range(len(firsts)):
        for b in range(a + 1, len(firsts)):
            n = min(len(firsts[a]), len(firsts[b]))
            assert np.abs(firsts[a][:n] - firsts[b][:n]).mean() > 1e-3


def test_streaming_endpoint_yields_pcm_chunks_then_the_whole_clip(client, ui):
    job = client.submit(*form("Hello world, this is a test.", seed=5), api_name="/speak")
    outputs = list(job)
    stream, stats, file = outputs[-1]
    assert [out[0]["done"] for out in outputs] == [False] * (len(outputs) - 1) + [True]
    assert len(stream["chunks"]) >= 2 and stream["rate"] == 24_000 and stream["ttfa"] > 0
    assert "TTFA" in stats and "streaming" not in stats
    pcm = np.concatenate([np.frombuffer(base64.b64decode(c), "<i2") for c in stream["chunks"]])
    clip = clip_of(ui, file)
    assert len(clip) == len(pcm) == reported_samples(stats) > 0 and len(clip) % 480 == 0
    assert np.array_equal(pcm, np.rint(clip * 32768).astype(np.int16))


def test_cancelling_a_streaming_job_aborts_its_engine_work(client, ui):
    health = ui.service.pipeline.health
    job = client.submit(
        *form("今天天气很好。我们去公园散步吧。然后回家吃饭。晚上一起看电影。"), api_name="/speak"
    )
    deadline = time.monotonic() + 30
    while health()["active_streams"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health()["active_streams"] == 1
    job.cancel()
    deadline = time.monotonic() + 5
    while health()["active_streams"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health()["active_streams"] == 0


@pytest.mark.parametrize("api_name", ["/speak", "/speak_clip"])
def test_bad_input_reaches_the_client_as_a_readable_error(client, api_name, tmp_path):
    with pytest.raises(AppError, match="The text is empty: type what the voice should say."):
        client.predict(*form(text="   "), api_name=api_name)
    with pytest.raises(AppError, match="Pick a voice"):
        client.predict(*form(voice=""), api_name=api_name)
    fake = tmp_path / "voice.wav"
    fake.write_text("not audio\n" * 50)
    with pytest.raises(AppError, match="Could not read voice.wav as audio"):
        client.predict(
            *form(voice="recording", recording=handle_file(str(fake)), prompt_text="hi"), api_name=api_name
        )
    with pytest.raises(AppError, match="The seed must be a whole number from 0 to"):
        client.predict(*form(seed=-1), api_name=api_name)
    with pytest.raises(AppError, match=re.escape("Speed must be between 0.5 and 2.0, got 3.0.")):
        client.predict(*form(speed=3.0), api_name=api_name)


def test_a_recording_can_be_used_without_saving_it(client, ui, recording):
    path, transcript = recording
    before = ui.service.voices.list_voices(None)
    _, stats, file = client.predict(
        *form(voice="recording", recording=handle_file(str(path)), prompt_text=transcript, seed=2),
        api_name="/speak_clip",
    )
    assert len(clip_of(ui, file)) == reported_samples(stats) > 0
    assert ui.service.voices.list_voices(None) == before


def test_whole_clips_play_on_a_machine_without_ffprobe(client, ui, monkeypatch, tmp_path):
    """Gradio probes audio files it is handed with ffprobe and fails when it is missing (only ffmpeg
    comes with imageio-ffmpeg); the player gets samples instead of a file, which it never probes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ffmpeg").symlink_to(imageio_ffmpeg.get_ffmpeg_exe())
    monkeypatch.setenv("PATH", str(bin_dir))
    _, stats, file = client.predict(*form(seed=6), api_name="/speak_clip")
    assert len(clip_of(ui, file)) == reported_samples(stats) > 0
