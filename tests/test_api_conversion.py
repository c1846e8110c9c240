"""Voice conversion through POST /v1/audio/conversions on a real server with the tiny model: whole,
streamed and SSE answers as long as the source (960 samples per source token), speed and seed, the
API key, and each bad input's message naming its field."""

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf
from test_server import make_service, serving

from cosyapp.frontend.source import source_tokens
from cosyapp.frontend.voices import ASSETS_VOICES
from cosyapp.web.server import build_app

KEY = "conversion-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SOURCE = ASSETS_VOICES / "en-espeak-us.wav"
VOICE = "zh-aishell-w0121"
SAMPLES_PER_TOKEN = 960  # two mel frames of 480 samples per 25 Hz token


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return make_service(tmp_path_factory, api_key=KEY, max_upload_mb=2)


@pytest.fixture(scope="module")
def api(service):
    with serving(build_app(service)) as base, httpx.Client(base_url=base, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokens(service):
    return source_tokens(service.voices.frontend, SOURCE)


def convert(api, data: bytes = SOURCE.read_bytes(), name="source.wav", headers=AUTH, **fields):
    fields = {"voice": VOICE} | {k: str(v) for k, v in fields.items()}
    return api.post("/v1/audio/conversions", headers=headers, data=fields, files={"file": (name, data)})


def samples_of(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    audio, rate = sf.read(io.BytesIO(response.content), dtype="float32")
    assert rate == 24_000 and audio.ndim == 1
    return audio


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768


def wav_of(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def error_of(response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_a_whole_conversion_lasts_as_long_as_its_source(api, tokens):
    audio = samples_of(convert(api, seed=1))
    seconds = sf.info(SOURCE).duration
    assert len(tokens) == pytest.approx(25 * seconds, abs=2)
    assert len(audio) == SAMPLES_PER_TOKEN * len(tokens)
    assert np.abs(audio).max() > 0.01  # sound, not silence


def test_the_same_seed_converts_to_the_same_audio_and_another_seed_differently(api):
    first = samples_of(convert(api, seed=3))
    again = samples_of(convert(api, seed=3))
    other = samples_of(convert(api, seed=4))
    np.testing.assert_allclose(again, first, atol=2 / 32768)
    assert len(other) == len(first) and not np.allclose(other, first, atol=1e-3)


def test_a_streamed_conversion_adds_up_to_the_whole_one(api):
    whole = convert(api, seed=5, response_format="pcm")
    with api.stream(
        "POST",
        "/v1/audio/conversions",
        headers=AUTH,
        data={"voice": VOICE, "seed": "5", "response_format": "pcm", "stream": "true"},
        files={"file": ("source.wav", SOURCE.read_bytes())},
    ) as streamed:
        assert streamed.status_code == 200 and streamed.headers["content-type"] == "audio/pcm"
        pieces = [piece for piece in streamed.iter_raw() if piece]
    # Streamed token2wav works chunk by chunk (as upstream's), so the samples differ a little.
    assert len(pieces) > 1 and len(b"".join(pieces)) == len(whole.content)


def test_sse_events_carry_the_audio_of_the_byte_stream(api):
    streamed = convert(api, seed=6, response_format="pcm", stream="true")
    response = convert(api, seed=6, response_format="pcm", stream_format="sse")
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == {"type": "speech.audio.done"}
    data = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    np.testing.assert_allclose(pcm(data), pcm(streamed.content), atol=2 / 32768)


def test_speed_half_doubles_the_length(api, tokens):
    slow = samples_of(convert(api, seed=1, speed=0.5))
    assert abs(len(slow) - 2 * SAMPLES_PER_TOKEN * len(tokens)) <= 480


def test_compressed_formats_decode_to_the_source_length(api, tokens):
    response = convert(api, seed=1, response_format="flac")
    assert response.headers["content-type"] == "audio/flac"
    assert len(samples_of(response)) == SAMPLES_PER_TOKEN * len(tokens)


def test_the_api_key_guards_the_endpoint(api):
    response = convert(api, headers={})
    assert response.status_code == 401, response.text


def test_a_silent_source_is_refused(api):
    message = error_of(convert(api, wav_of(np.zeros(32_000, np.float32), 16_000)), 400, "file")
    assert message == "The recording is silent (peak level below -60 dBFS): check the microphone or the file."


def test_a_source_over_30_s_is_refused_with_the_limit(api):
    long = 0.1 * np.sin(np.arange(16_000 * 31) * 0.05).astype(np.float32)
    message = error_of(convert(api, wav_of(long, 16_000)), 400, "file")
    assert message == (
        "The recording is too long (31.0 s): the speech to convert may be at most 30 s. "
        "Trim it and try again."
    )


def test_a_source_below_16_khz_is_refused(api):
    audio, rate = sf.read(SOURCE, dtype="float32")
    narrow = audio[:: rate // 8000] if rate % 8000 == 0 else audio[::2]
    message = error_of(convert(api, wav_of(narrow, 8000)), 400, "file")
    assert message == (
        "The recording's sample rate is 8000 Hz; the speech to convert needs at least 16 kHz. "
        "Record or export it at 16 kHz or more."
    )


def test_a_file_that_is_not_audio_is_refused(api):
    message = error_of(convert(api, b"hello, this is text", name="notes.txt"), 400, "file")
    assert message.startswith("Could not read the uploaded file as audio: it is corrupt or not in a format")


def test_a_source_under_one_second_is_refused(api):
    short = 0.1 * np.sin(np.arange(8000) * 0.05).astype(np.float32)
    message = error_of(convert(api, wav_of(short, 16_000)), 400, "file")
    assert message == (
        "The recording is too short (0.50 s): the speech to convert needs at least 1 s of speech."
    )


def test_an_unknown_voice_is_a_404(api):
    response = convert(api, voice="nobody")
    assert error_of(response, 404, "voice") == "Voice 'nobody' not found; pick one of the listed voices."


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": "ogg"}, "response_format", "Unsupported response_format 'ogg'"),
        ({"stream_format": "chunks"}, "stream_format", "Unsupported stream_format 'chunks'"),
        ({"stream": "maybe"}, "stream", "must be true or false"),
        ({"speed": "fast"}, "speed", "Speed must be between 0.5 and 2.0, got 'fast'"),
        ({"speed": "3"}, "speed", "Speed must be between 0.5 and 2.0, got 3.0"),
        ({"seed": "-1"}, "seed", "The seed must be a whole number"),
        ({"language": "en"}, "language", "Unknown field 'language'"),
    ],
)
def test_bad_fields_are_refused_naming_them(api, fields, param, words):
    assert words in error_of(convert(api, **fields), 400, param)


def test_a_missing_file_a_text_file_field_or_a_json_body_is_refused(api):
    def post(**parts):
        return api.post("/v1/audio/conversions", headers=AUTH, files={k: (None, v) for k, v in parts.items()})

    missing = post(voice=VOICE)
    assert error_of(missing, 400, "file") == "The field 'file' is missing: send the recording as a file."
    as_text = post(voice=VOICE, file="text")
    assert error_of(as_text, 400, "file") == "The field 'file' must be a file (multipart with a filename)."
    as_json = api.post("/v1/audio/conversions", headers=AUTH, json={"voice": VOICE})
    assert error_of(as_json, 400, None).startswith("Send the request as multipart/form-data")
