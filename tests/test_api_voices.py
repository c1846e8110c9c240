"""Voices and transcription through the HTTP API, on a real server with the tiny TTS and ASR models:
create (with and without a transcript) -> speak -> list -> delete -> 404, uploads in phone and
browser formats, the documented errors, and the API key."""

import io

import httpx
import numpy as np
import pytest
import soundfile as sf
from test_prompt_formats import FORMATS, MIN_SNR_DB, convert, ffmpeg
from test_server import make_service, serving

from cosyapp.asr import LANGUAGES
from cosyapp.frontend.voices import ASSETS_VOICES
from cosyapp.web.server import build_app

KEY = "voices-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
AISHELL = ASSETS_VOICES / "zh-aishell-w0121.wav"
AISHELL_TEXT = "甚至出现交易几乎停滞的情况"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    service = make_service(tmp_path_factory, api_key=KEY, max_upload_mb=1)
    with serving(build_app(service)) as base, httpx.Client(base_url=base, timeout=120) as client:
        yield client


def create(api, path, name="API voice", transcript=None, **extra):
    data = {"name": name} | ({"transcript": transcript} if transcript is not None else {}) | extra
    with open(path, "rb") as f:
        return api.post("/v1/audio/voices", headers=AUTH, data=data, files={"file": (path.name, f)})


def speak(api, voice):
    return api.post(
        "/v1/audio/speech",
        headers=AUTH,
        json={"input": "Hello there.", "voice": voice, "seed": 1, "response_format": "wav"},
    )


def error_of(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


def prompt_audio(api, voice_id) -> tuple[np.ndarray, int]:
    response = api.get(f"/v1/audio/voices/{voice_id}/audio", headers=AUTH)
    assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
    samples, rate = sf.read(io.BytesIO(response.content), dtype="float32")
    return samples, rate


def test_a_voice_with_its_transcript_goes_round_the_api(api):
    made = create(api, AISHELL, name="Round trip", transcript=AISHELL_TEXT)
    assert made.status_code == 200, made.text
    voice = made.json()
    assert voice["id"].startswith("user-") and voice["object"] == "voice" and voice["kind"] == "user"
    assert (voice["name"], voice["transcript"], voice["transcript_source"]) == (
        "Round trip",
        AISHELL_TEXT,
        "given",
    )
    assert voice["prepared"].startswith("Using 3.5 s (0.4-3.8 s of 4.2 s)")
    spoken = speak(api, voice["id"])
    assert spoken.status_code == 200 and spoken.content[:4] == b"RIFF"
    listed = api.get("/v1/audio/voices", headers=AUTH).json()["data"]
    assert voice["id"] in {v["id"] for v in listed}
    got = api.get(f"/v1/audio/voices/{voice['id']}", headers=AUTH).json()
    assert got == {k: v for k, v in voice.items() if k not in ("transcript_source", "prepared")}
    deleted = api.delete(f"/v1/audio/voices/{voice['id']}", headers=AUTH)
    assert deleted.json() == {"id": voice["id"], "object": "voice", "deleted": True}
    assert error_of(api.get(f"/v1/audio/voices/{voice['id']}", headers=AUTH), 404)["message"] == (
        f"Voice {voice['id']!r} not found; pick one of the listed voices."
    )
    assert speak(api, voice["id"]).status_code == 404
    assert voice["id"] not in {v["id"] for v in api.get("/v1/audio/voices", headers=AUTH).json()["data"]}


def test_a_voice_without_a_transcript_is_transcribed(api):
    made = create(api, AISHELL, name="Transcribed")
    assert made.status_code == 200, made.text
    voice = made.json()
    assert voice["transcript_source"] == "demo-asr"  # the demo server's recogniser has random weights
    assert voice["transcript"] and voice["language"] in LANGUAGES
    assert speak(api, voice["id"]).status_code == 200
    api.delete(f"/v1/audio/voices/{voice['id']}", headers=AUTH)


def test_the_saved_prompt_is_the_prepared_recording(api, tmp_path):
    padded = tmp_path / "padded.wav"
    samples, rate = sf.read(AISHELL, dtype="float32")
    sf.write(
        padded, np.concatenate([np.zeros(2 * rate, np.float32), samples, np.zeros(rate, np.float32)]), rate
    )
    plain, with_silence = (create(api, p, transcript=AISHELL_TEXT).json() for p in (AISHELL, padded))
    (a, rate_a), (b, rate_b) = prompt_audio(api, plain["id"]), prompt_audio(api, with_silence["id"])
    assert rate_a == rate_b == 16_000
    assert len(a) == len(b) == round(3.5 * 16_000) or abs(len(a) - len(b)) <= 160  # one hop
    assert with_silence["prepared"].startswith("Using 3.5 s (2.4-5.8 s of 7.2 s): silence trimmed")


@pytest.mark.parametrize("suffix", FORMATS)
def test_a_compressed_upload_makes_the_voice_of_its_wav(api, tmp_path, suffix):
    reference = prompt_audio(api, create(api, AISHELL, transcript=AISHELL_TEXT).json()["id"])[0]
    made = create(api, convert(AISHELL, tmp_path, suffix), transcript=AISHELL_TEXT)
    assert made.status_code == 200, made.text
    samples, rate = prompt_audio(api, made.json()["id"])
    assert rate == (48_000 if suffix == "webm" else 16_000)
    if rate != 16_000:
        from test_prompt_formats import at_16k

        from cosyapp.frontend.audio import PromptAudio

        samples = at_16k(PromptAudio(samples, rate))
    # Trimming decides on 10 ms frames: the decoded file's clip may start a hop apart from the WAV's.
    best = max(range(-160, 161, 160), key=lambda lag: overlap_snr(reference, samples, lag))
    assert abs(len(samples) - len(reference)) <= 320
    assert overlap_snr(reference, samples, best) >= MIN_SNR_DB[suffix]


def overlap_snr(reference: np.ndarray, other: np.ndarray, lag: int) -> float:
    """Signal-to-error ratio (dB) of ``other`` shifted by ``lag`` samples against ``reference``."""
    a, b = (reference[lag:], other) if lag >= 0 else (reference, other[-lag:])
    n = min(len(a), len(b))
    return float(10 * np.log10(np.sum(a[:n] ** 2) / np.sum((a[:n] - b[:n]) ** 2)))


def test_a_phone_3gp_at_8_khz_is_refused_naming_the_file_field(api, tmp_path):
    phone = tmp_path / "phone.3gp"
    ffmpeg(AISHELL, phone, "-ar", "8000", "-c:a", "libopencore_amrnb", "-b:a", "12.2k")
    error = error_of(create(api, phone, transcript=AISHELL_TEXT), 400)
    assert error["param"] == "file"
    assert error["message"].startswith(
        "The recording's sample rate is 8000 Hz; a voice prompt needs at least 16 kHz"
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not audio at all\n" * 50, "Could not read the uploaded file as audio: it is corrupt or not in a"),
        (None, "The recording is silent (peak level below -60 dBFS)"),
    ],
)
def test_a_bad_file_is_a_400_on_the_file_field(api, tmp_path, content, message):
    path = tmp_path / "notes.wav"
    if content is None:
        sf.write(path, np.zeros(32_000, np.float32), 16_000)
    else:
        path.write_bytes(content)
    error = error_of(create(api, path, transcript="hello"), 400)
    assert error["param"] == "file" and error["message"].startswith(message)


def test_a_file_over_the_upload_limit_is_a_413(api, tmp_path):
    big = tmp_path / "big.wav"
    sf.write(big, np.random.default_rng(0).uniform(-0.5, 0.5, 600_000).astype(np.float32), 16_000)  # 1.2 MB
    error = error_of(create(api, big, transcript="hello"), 413)
    assert error["code"] == "request_too_large"


@pytest.mark.parametrize(
    "name, param, message",
    [
        ("/// <> ///", "name", "Give the voice a name made of letters, digits or punctuation"),
        ("Good name", "transcript", "The transcript is too long for the recording"),
    ],
)
def test_a_bad_name_or_transcript_is_a_400_naming_its_field(api, name, param, message):
    error = error_of(create(api, AISHELL, name=name, transcript="这是一个很长的句子" * 10), 400)
    assert error["param"] == param and error["message"].startswith(message)


def test_the_form_must_hold_a_file_a_name_and_nothing_else(api):
    assert error_of(api.post("/v1/audio/voices", headers=AUTH, json={"name": "x"}), 400)["message"] == (
        "Send the request as multipart/form-data with the fields file, name, transcript."
    )
    no_file = api.post("/v1/audio/voices", headers=AUTH, data={"name": "x"}, files={"other": ("a", b"1")})
    assert (
        error_of(no_file, 400)["message"]
        == "Unknown field 'other'; this endpoint takes file, name, transcript."
    )
    error = error_of(create(api, AISHELL, name="", transcript=AISHELL_TEXT), 400)
    assert error["param"] == "name"
    with open(AISHELL, "rb") as f:
        nameless = api.post("/v1/audio/voices", headers=AUTH, files={"file": ("a.wav", f)})
    assert error_of(nameless, 400) == {
        "message": "The field 'name' is missing: send it.",
        "type": "invalid_request_error",
        "param": "name",
        "code": None,
    }


def test_every_voice_route_needs_the_api_key(api):
    with open(AISHELL, "rb") as f:
        files = {"file": ("a.wav", f.read())}
    for response in [
        api.post("/v1/audio/voices", data={"name": "x"}, files=files),
        api.get("/v1/audio/voices/zh-aishell-w0121"),
        api.get("/v1/audio/voices/zh-aishell-w0121/audio"),
        api.post("/v1/audio/transcriptions", files=files),
        api.delete("/v1/audio/voices/user-000000000000"),
    ]:
        assert error_of(response, 401)["code"] == "missing_api_key"


def test_a_built_in_voice_has_its_transcript_and_recording(api):
    voice = api.get("/v1/audio/voices/zh-aishell-w0121", headers=AUTH).json()
    assert (voice["kind"], voice["language"], voice["transcript"]) == ("builtin", "zh", AISHELL_TEXT)
    samples, rate = prompt_audio(api, "zh-aishell-w0121")
    np.testing.assert_allclose(samples, sf.read(AISHELL, dtype="float32")[0], atol=1 / 32767)


@pytest.mark.parametrize("response_format", ["json", "verbose_json", "text"])
def test_a_transcription_in_each_format(api, response_format):
    with open(AISHELL, "rb") as f:
        response = api.post(
            "/v1/audio/transcriptions",
            headers=AUTH,
            data={"model": "whisper-1", "response_format": response_format},
            files={"file": ("a.wav", f)},
        )
    assert response.status_code == 200, response.text
    if response_format == "text":
        assert response.text and response.headers["content-type"].startswith("text/plain")
        return
    body = response.json()
    assert body["text"] and body["demo"] is True
    if response_format == "verbose_json":
        assert body["language"] in LANGUAGES and body["duration"] == pytest.approx(4.204, abs=1e-3)


def test_a_transcription_in_a_given_language_and_a_refused_one(api):
    with open(AISHELL, "rb") as f:
        audio = f.read()
    given = api.post(
        "/v1/audio/transcriptions",
        headers=AUTH,
        data={"language": "yue", "response_format": "verbose_json"},
        files={"file": ("a.wav", audio)},
    )
    assert given.json()["language"] == "yue"
    refused = api.post(
        "/v1/audio/transcriptions", headers=AUTH, data={"language": "fr"}, files={"file": ("a.wav", audio)}
    )
    assert error_of(refused, 400) == {
        "message": "Unsupported language 'fr'; use one of: zh, yue, en, ja, ko.",
        "type": "invalid_request_error",
        "param": "language",
        "code": None,
    }


def test_without_asr_a_voice_needs_its_transcript(tmp_path_factory):
    service = make_service(tmp_path_factory, asr_model=None)
    with serving(build_app(service)) as base, httpx.Client(base_url=base, timeout=120) as client:
        error = error_of(create(client, AISHELL), 400)
        assert error["param"] == "transcript"
        assert (
            error["message"]
            == "Automatic transcription is off on this server: type what is said in the recording."
        )
        assert create(client, AISHELL, transcript=AISHELL_TEXT).status_code == 200
