"""The HTTP server over the tiny demo model, served by uvicorn on a free port (as in production).

Requests go through httpx over real sockets, so streaming and client disconnects behave as they do for
real clients. One server serves most tests; the busy and lifecycle tests get their own one-stream one.
"""

import asyncio
import io
import os
import struct
import time
import wave
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

from cosyapp.service import build_service  # noqa: E402
from cosyapp.settings import Settings  # noqa: E402
from cosyapp.web.server import EngineStart, build_app, serve_in_thread  # noqa: E402

VOICE = "zh-aishell-w0121"
SHORT = "Hello there."
LONG = "Hello there. How are you today? Fine thanks."
SAMPLES_PER_TOKEN = 480  # 24 kHz / 25 Hz tokens / 2: audio always comes in whole token hops


serving = serve_in_thread  # the other server tests import it from here


def make_service(tmp_path_factory, **overrides):
    root = tmp_path_factory.getbasetemp()  # one demo model and one feature cache for every service
    folders = {"cache_dir": root / "cache", "data_dir": root / "data"}
    options = {"demo": True, "engine": "torch", "device": "cpu", "max_streams": 4, **folders, **overrides}
    return build_service(Settings(**options))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return make_service(tmp_path_factory)


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def speech(client, **body):
    """POST /v1/audio/speech of SHORT in VOICE as WAV, unless ``body`` says otherwise."""
    return client.post(
        "/v1/audio/speech", json={"input": SHORT, "voice": VOICE, "response_format": "wav", **body}
    )


@pytest.fixture(scope="module")
def clip(client):
    """A whole WAV of SHORT with seed 7."""
    response = speech(client, seed=7)
    assert response.status_code == 200, response.text
    return response


def read_wav(data: bytes) -> tuple[tuple[int, int, int], bytes]:
    """((rate, channels, sample width), PCM data) of a WAV; the data follows a 44-byte header."""
    with wave.open(io.BytesIO(data)) as reader:
        return (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()), data[44:]


def wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def requests_total(client) -> dict[str, float]:
    """Requests started ("requests") and finished or refused, by outcome, from /metrics."""
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    totals = {s.labels["outcome"]: s.value for s in families["cosyapp_requests"].samples}
    totals["requests"] = families["cosyapp_requests_started"].samples[0].value
    return totals


def test_speech_returns_a_24khz_mono_16bit_wav(clip):
    with wave.open(io.BytesIO(clip.content)) as reader:
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (24000, 1, 2)
        samples = reader.getnframes()
    assert clip.headers["content-type"] == "audio/wav"
    assert samples == len(clip.content[44:]) // 2 > 0 and samples % SAMPLES_PER_TOKEN == 0
    assert struct.unpack("<I", clip.content[4:8])[0] == len(clip.content) - 8


def test_pcm_is_the_wav_data_without_a_header_for_the_same_seed(client, clip):
    response = speech(client, seed=7, response_format="pcm")
    assert response.status_code == 200 and response.headers["content-type"] == "audio/pcm"
    assert response.content == read_wav(clip.content)[1]


def test_the_same_seed_gives_identical_bytes(client, clip):
    assert speech(client, seed=7).content == clip.content
    assert speech(client, seed=8).content != clip.content


def test_streaming_sends_audio_while_the_clip_is_still_being_made(client, service):
    whole = speech(client, input=LONG, seed=3)
    chunks, active_at_first_audio = [], None
    with client.stream(
        "POST",
        "/v1/audio/speech",
        json={"input": LONG, "voice": VOICE, "seed": 3, "stream": True, "response_format": "wav"},
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
        for chunk in response.iter_raw():
            if active_at_first_audio is None and sum(map(len, chunks)) + len(chunk) > 44:
                active_at_first_audio = service.pipeline.health()["active_streams"]
            chunks.append(chunk)
    streamed = b"".join(chunks)
    assert active_at_first_audio == 1  # the request was still running when audio arrived
    assert len(chunks) > 2
    assert struct.unpack("<I", streamed[4:8])[0] == struct.unpack("<I", streamed[40:44])[0] == 0xFFFFFFFF
    form, data = read_wav(streamed)
    assert form == (24000, 1, 2)
    assert len(data) == len(read_wav(whole.content)[1])  # streamed samples differ, the length does not


def test_streamed_pcm_is_headerless_and_as_long_as_the_whole_clip(client, clip):
    body = {"input": SHORT, "voice": VOICE, "seed": 7, "stream": True, "response_format": "pcm"}
    with client.stream("POST", "/v1/audio/speech", json=body) as response:
        data = response.read()
    assert response.headers["content-type"] == "audio/pcm"
    assert not data.startswith(b"RIFF") and len(data) == len(read_wav(clip.content)[1])


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"input": ""}, 400, "input", "empty"),
        ({"voice": "nobody"}, 404, "voice", "not found"),
        ({"speed": 3.0}, 400, "speed", "between 0.5 and 2.0"),
        ({"response_format": "ogg"}, 400, "response_format", "mp3, opus, aac, flac, wav, pcm"),
        ({"input": 5}, 422, "input", "valid string"),
        ({"speed": "fast"}, 422, "speed", "valid number"),
        ({"stream": "yes"}, 422, "stream", "valid boolean"),
        ({"seed": -1}, 400, "seed", "whole number from 0 to"),
        ({"temperature": 0.5}, 422, "temperature", "Extra inputs"),
    ],
)
def test_bad_requests_get_a_json_error_naming_the_field(client, body, status, param, words):
    response = speech(client, **body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error")


def test_malformed_json_is_a_400(client):
    response = client.post(
        "/v1/audio/speech", content=b'{"input": "Hi", ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_voices_lists_the_built_in_voices(client):
    voices = {v["id"]: v for v in client.get("/v1/audio/voices").json()["data"]}
    assert voices[VOICE]["kind"] == "builtin"
    assert {"en-espeak-gb", "en-espeak-us", "zh-aishell-w0122"} <= set(voices)


def test_metrics_are_prometheus_text_counting_the_requests(client):
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    before = requests_total(client)
    speech(client, seed=1)
    speech(client, input="")  # refused by the text frontend: never reaches the engines
    after = requests_total(client)
    assert after["requests"] == before["requests"] + 1 and after["done"] == before["done"] + 1


def test_health_reports_the_engine_and_demo_mode(client, service):
    response = client.get("/health")
    assert response.status_code == 200
    health = response.json()
    assert health["status"] == "serving" and health["started"] and health["error"] is None
    assert health["demo"] and health["demo_reason"] == "started with --demo"
    assert health["engine"] == "torch" and health["device"] == "cpu"
    assert health["model"] == str(service.model_dir)
    assert health["active_streams"] == 0 and health["waiting"] == 0


def test_a_client_leaving_mid_stream_frees_its_stream_and_aborts_the_lm(client, service):
    before = requests_total(client)
    with client.stream(
        "POST", "/v1/audio/speech", json={"input": LONG * 4, "voice": VOICE, "seed": 5, "stream": True}
    ) as response:
        audio = response.iter_raw()
        next(audio)
        assert service.pipeline.health()["active_streams"] == 1
    wait_until(lambda: service.pipeline.health()["active_streams"] == 0)
    wait_until(lambda: service.pipeline.lm.stats().running == 0)
    after = requests_total(client)
    assert after["cancelled"] == before["cancelled"] + 1 and after["done"] == before["done"]


@pytest.fixture(scope="module")
def one_stream_app(tmp_path_factory):
    service = make_service(tmp_path_factory, max_streams=1)
    service.pipeline.admission.max_waiting = 0  # no waiting room: a second request is refused at once
    return service, build_app(service)


def test_health_is_503_before_the_engines_start_and_after_they_stop(one_stream_app):
    service, app = one_stream_app
    assert TestClient(app).get("/health").status_code == 503  # no lifespan: nothing started
    with serving(app) as base:
        assert httpx.get(f"{base}/health").status_code == 200
    response = TestClient(app).get("/health")
    assert response.status_code == 503 and response.json()["status"] == "stopped"


def test_a_full_server_answers_503_with_retry_after(one_stream_app):
    service, app = one_stream_app
    with (
        serving(app) as base,
        httpx.Client(base_url=base, timeout=120) as first,
        httpx.Client(base_url=base, timeout=120) as second,
    ):
        body = {"input": LONG * 4, "voice": VOICE, "seed": 5, "stream": True}
        with first.stream("POST", "/v1/audio/speech", json=body) as running:
            audio = running.iter_raw()  # kept: dropping the iterator would close the connection
            next(audio)
            assert service.pipeline.health()["active_streams"] == 1  # it holds the only stream slot
            response = speech(second)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "server_busy" and "busy" in error["message"]


def test_health_tells_a_start_in_progress_from_a_failed_one():
    async def states() -> list[tuple[str, str | None]]:
        start = EngineStart()
        seen = [(start.state(False), start.error())]
        start.task = asyncio.create_task(asyncio.sleep(60))
        seen.append((start.state(False), start.error()))
        start.task.cancel()

        async def no_gpu():
            raise RuntimeError("CUDA out of memory")

        start.task = asyncio.create_task(no_gpu())
        await asyncio.wait([start.task])
        seen.append((start.state(False), start.error()))
        return seen

    assert asyncio.run(states()) == [
        ("not started", None),
        ("starting", None),
        ("failed", "RuntimeError: CUDA out of memory"),
    ]


AISHELL = Path(__file__).resolve().parents[1] / "assets" / "voices" / "zh-aishell-w0121.wav"
AISHELL_TEXT = "甚至出现交易几乎停滞的情况"


def listed_voices(client) -> set[str]:
    return {v["id"] for v in client.get("/v1/audio/voices").json()["data"]}


def test_a_shared_voice_is_deleted_through_the_api_and_is_gone(client, service):
    info = service.voices.save("Team voice", str(AISHELL), AISHELL_TEXT, session="s1", shared=True)
    assert info.id in listed_voices(client)
    response = client.delete(f"/v1/audio/voices/{info.id}")
    assert response.status_code == 200
    assert response.json() == {"id": info.id, "object": "voice", "deleted": True}
    assert info.id not in listed_voices(client)
    speaking = speech(client, voice=info.id)
    assert speaking.status_code == 404 and speaking.json()["error"]["param"] == "voice"
    again = client.delete(f"/v1/audio/voices/{info.id}")
    assert again.status_code == 404 and again.json()["error"] == {
        "message": f"Voice {info.id!r} not found; pick one of the listed voices.",
        "type": "not_found_error",
        "param": "voice",
        "code": None,
    }


def test_deleting_a_voice_the_api_cannot_see_is_a_404_and_keeps_it(client, service):
    private = service.voices.save("Mine", str(AISHELL), AISHELL_TEXT, session="s2", shared=False)
    for voice_id in [private.id, "user-0123456789ab", "nobody", "user-.."]:
        response = client.delete(f"/v1/audio/voices/{voice_id}")
        assert response.status_code == 404, voice_id
        assert response.json()["error"]["type"] == "not_found_error"
    assert service.voices.get(private.id, "s2").info.name == "Mine"


def test_built_in_voices_cannot_be_deleted(client):
    response = client.delete(f"/v1/audio/voices/{VOICE}")
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"Voice {VOICE!r} comes with the server and cannot be deleted; only saved voices can.",
        "type": "invalid_request_error",
        "param": "voice",
        "code": None,
    }
    assert VOICE in listed_voices(client)
