"""Bad text, parameters and bodies sent to POST /v1/audio/speech: each gets its status and JSON error.

The expected messages are the rows of docs/hardening.md. The app runs with its lifespan in a
TestClient, over the tiny demo model, with a 200-character text limit.
"""

import os

import pytest
from fastapi.testclient import TestClient

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

from cosyapp.service import build_service  # noqa: E402
from cosyapp.settings import Settings  # noqa: E402
from cosyapp.web.api_guard import max_body_bytes  # noqa: E402
from cosyapp.web.server import build_app  # noqa: E402

VOICE = "en-espeak-us"
MAX_CHARS = 200
JSON = {"content-type": "application/json"}
PLAIN = {"content-type": "text/plain"}
EMPTY = "The text is empty: type what the voice should say."
TOO_LONG = "The text is 201 characters long; the limit is 200. Shorten it or send it in parts."
NOTHING = (
    "The text has nothing to read aloud: it has no letters or digits, only punctuation, symbols or emoji."
)
CYRILLIC = (
    "The text is written in a script this model cannot read (Cyrillic). "
    "CosyVoice 2 reads Chinese, English, Japanese and Korean."
)
NOT_AN_OBJECT = "the body must be a JSON object (Content-Type: application/json)"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    settings = Settings(
        demo=True,
        engine="torch",
        device="cpu",
        max_streams=2,
        max_text_chars=MAX_CHARS,
        cache_dir=tmp_path_factory.getbasetemp() / "cache",
        data_dir=root / "data",
    )
    with TestClient(build_app(build_service(settings))) as client:
        yield client


def speech(client, **body):
    return client.post(
        "/v1/audio/speech",
        json={"input": "Hello there.", "voice": VOICE, "seed": 1, "response_format": "wav", **body},
    )


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("", EMPTY),
        ("  \n\t ", EMPTY),
        ("\x00\x01\x1b", EMPTY),
        ("x" * (MAX_CHARS + 1), TOO_LONG),
        ("!!! ???", NOTHING),
        ("🎉👍🏽❤️", NOTHING),
        ("Привет, мир", CYRILLIC),
    ],
)
def test_bad_text_is_a_400_with_its_message(client, text, message):
    error = error_of(speech(client, input=text), 400)
    assert error == {"message": message, "type": "invalid_request_error", "param": "input", "code": None}


def test_control_characters_and_a_lone_surrogate_are_removed_and_the_rest_is_spoken(client):
    clean = speech(client, input="Hello there.")
    body = (
        b'{"input": "Hel\\u0000lo\\u001b there.\\ud800", "voice": "en-espeak-us", "seed": 1, '
        b'"response_format": "wav"}'
    )
    dirty = client.post("/v1/audio/speech", content=body, headers=JSON)
    assert clean.status_code == dirty.status_code == 200
    assert dirty.content == clean.content and len(clean.content) > 44


@pytest.mark.parametrize(
    "body, status, param, message",
    [
        ({"speed": 0.49}, 400, "speed", "Speed must be between 0.5 and 2.0, got 0.49."),
        ({"speed": 2.01}, 400, "speed", "Speed must be between 0.5 and 2.0, got 2.01."),
        ({"seed": -1}, 400, "seed", f"The seed must be a whole number from 0 to {2**63 - 1}, got -1."),
        (
            {"seed": 2**63},
            400,
            "seed",
            f"The seed must be a whole number from 0 to {2**63 - 1}, got {2**63}.",
        ),
        ({"seed": 1.5}, 422, "seed", "seed: Input should be a valid integer"),
        ({"seed": "1"}, 422, "seed", "seed: Input should be a valid integer"),
        ({"speed": "fast"}, 422, "speed", "speed: Input should be a valid number"),
        ({"voice": 5}, 422, "voice", "voice: Input should be a valid string"),
        ({"input": None}, 422, "input", "input: Input should be a valid string"),
        ({"stream": "yes"}, 422, "stream", "stream: Input should be a valid boolean"),
        ({"temperature": 0.5}, 422, "temperature", "temperature: Extra inputs are not permitted"),
        (
            {"response_format": "ogg"},
            400,
            "response_format",
            "Unsupported response_format 'ogg'; use one of: mp3, opus, aac, flac, wav, pcm.",
        ),
        ({"voice": "nobody"}, 404, "voice", "Voice 'nobody' not found; pick one of the listed voices."),
    ],
)
def test_bad_parameters_get_their_status_and_message(client, body, status, param, message):
    """The messages in full are in docs/hardening.md; the ones cut here end with a fixed hint."""
    error = error_of(speech(client, **body), status)
    assert error["param"] == param and error["message"].startswith(message)


@pytest.mark.parametrize(
    "voice", ["../../etc/passwd", "user-../../data", "/etc/hostname", "en-espeak-us/../x"]
)
def test_voice_ids_that_look_like_paths_are_simply_not_found(client, voice):
    error = error_of(speech(client, voice=voice), 404)
    assert error["type"] == "not_found_error" and error["message"].startswith(f"Voice {voice!r} not found")


@pytest.mark.parametrize("raw, speed", [(b"NaN", "nan"), (b"Infinity", "inf"), (b"-Infinity", "-inf")])
def test_non_finite_speed_is_out_of_range(client, raw, speed):
    body = b'{"input": "Hi", "voice": "en-espeak-us", "speed": ' + raw + b"}"
    error = error_of(client.post("/v1/audio/speech", content=body, headers=JSON), 400)
    assert error["message"] == f"Speed must be between 0.5 and 2.0, got {speed}."


def test_a_non_finite_seed_is_not_an_integer(client):
    body = b'{"input": "Hi", "voice": "en-espeak-us", "seed": NaN}'
    error = error_of(client.post("/v1/audio/speech", content=body, headers=JSON), 422)
    assert error["message"] == "seed: Input should be a valid integer"


@pytest.mark.parametrize(
    "raw, headers, status, start",
    [
        (b'{"input": "Hi", ', JSON, 400, "the body is not valid JSON"),
        (b"[]", JSON, 422, NOT_AN_OBJECT),
        (b'"Hi"', JSON, 422, NOT_AN_OBJECT),
        (b'{"input": "Hi", "voice": "en-espeak-us"}', PLAIN, 422, NOT_AN_OBJECT),
        (b"", JSON, 422, "the body is empty: send a JSON object with at least input and voice"),
        (b'{"voice": "en-espeak-us"}', JSON, 422, "input: Field required"),
        (b'{"input": "Hi"}', JSON, 422, "voice: Field required"),
    ],
)
def test_malformed_bodies_get_a_json_error(client, raw, headers, status, start):
    error = error_of(client.post("/v1/audio/speech", content=raw, headers=headers), status)
    assert error["message"].startswith(start) and error["type"] == "invalid_request_error"


def test_any_model_name_is_accepted_as_openai_clients_send_one(client):
    assert speech(client, model="tts-1").content == speech(client).content


def test_a_body_larger_than_any_valid_request_is_a_413_before_it_is_read(client):
    limit = max_body_bytes(MAX_CHARS)
    body = b'{"input": "' + b"a" * limit + b'", "voice": "en-espeak-us"}'
    error = error_of(client.post("/v1/audio/speech", content=body, headers=JSON), 413)
    assert (
        error["message"] == f"The request body is larger than {limit:,} bytes, more than any valid request."
    )
    assert error["code"] == "request_too_large"


def test_a_chunked_body_without_a_length_is_capped_too(client):
    def chunks():
        yield b'{"input": "'
        for _ in range(10):
            yield b"a" * (max_body_bytes(MAX_CHARS) // 8)

    response = client.post("/v1/audio/speech", content=chunks(), headers=JSON)
    assert "content-length" not in response.request.headers
    assert error_of(response, 413)["code"] == "request_too_large"


def test_a_chunked_body_within_the_limit_is_served(client):
    def chunks():
        yield b'{"input": "Hello there.", '
        yield b'"voice": "en-espeak-us", "seed": 1, "response_format": "wav"}'

    response = client.post("/v1/audio/speech", content=chunks(), headers=JSON)
    assert response.status_code == 200 and response.content == speech(client).content
