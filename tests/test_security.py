"""Security settings of a served app (mounted as in production, uvicorn on loopback): the API key on
/v1, the UI login, what Gradio serves and accepts as files, the upload limit, and the warnings."""

import os

import httpx
import numpy as np
import pytest
import soundfile as sf
from gradio_client import Client
from test_server import serving

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

from app import security_warnings  # noqa: E402
from cosyapp.service import build_service  # noqa: E402
from cosyapp.settings import Settings, parse_settings  # noqa: E402
from cosyapp.web.server import build_app  # noqa: E402

KEY = "test-key-5f2c"
LOGIN = ("ada", "s3cret:with:colons")
SPEECH = {"input": "Hello there.", "voice": "en-espeak-us", "seed": 1, "response_format": "wav"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """(base URL, settings) of an app with an API key, a UI login and a 1 MB upload limit."""
    root = tmp_path_factory.mktemp("guarded")
    settings = Settings(
        demo=True,
        engine="torch",
        device="cpu",
        max_streams=2,
        max_upload_mb=1,
        auth=LOGIN,
        api_key=KEY,
        cache_dir=tmp_path_factory.getbasetemp() / "cache",
        data_dir=root / "data",
    )
    with serving(build_app(build_service(settings))) as base:
        yield base, settings


@pytest.fixture(scope="module")
def logged_in(guarded):
    """An HTTP client with the UI's login cookie."""
    base, _ = guarded
    with httpx.Client(base_url=base, timeout=120) as client:
        response = client.post("/login", data={"username": LOGIN[0], "password": LOGIN[1]})
        assert response.status_code == 200, response.text
        yield client


def test_the_api_without_a_key_is_a_401_json_error(guarded):
    base, _ = guarded
    for headers in [{}, {"authorization": "Basic YWRhOnMzY3JldA=="}, {"authorization": "Token abc"}]:
        response = httpx.post(f"{base}/v1/audio/speech", json=SPEECH, headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == "missing_api_key"
        assert error["message"] == "Missing API key: send it in the header 'Authorization: Bearer <key>'."
    assert httpx.get(f"{base}/v1/audio/voices").status_code == 401
    assert httpx.delete(f"{base}/v1/audio/voices/user-0123456789ab").status_code == 401


def test_a_wrong_key_is_a_401_before_the_body_is_even_parsed(guarded):
    base, _ = guarded
    headers = {"authorization": "Bearer wrong", "content-type": "application/json"}
    response = httpx.post(f"{base}/v1/audio/speech", content=b'{"input": ', headers=headers)
    assert response.status_code == 401
    assert response.json()["error"] == {
        "message": "Invalid API key.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }


def test_the_right_key_as_openai_clients_send_it_is_served(guarded):
    base, _ = guarded
    response = httpx.post(
        f"{base}/v1/audio/speech", json=SPEECH, headers={"authorization": f"Bearer {KEY}"}, timeout=120
    )
    assert response.status_code == 200 and response.content.startswith(b"RIFF")


def test_health_and_metrics_stay_open_for_probes(guarded):
    base, _ = guarded
    assert httpx.get(f"{base}/health").status_code == 200
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.status_code == 200 and "cosyapp_requests_started_total" in metrics.text


def test_the_ui_and_its_gradio_api_need_the_login(guarded):
    base, _ = guarded
    assert httpx.get(f"{base}/config").status_code == 401
    with pytest.raises(ValueError, match="login"):
        Client(base, verbose=False)
    with pytest.raises(ValueError, match="Could not login"):
        Client(base, auth=(LOGIN[0], "wrong"), verbose=False)
    client = Client(base, auth=LOGIN, download_files=False, verbose=False)
    _, stats, _ = client.predict("Hello there.", "en-espeak-us", None, "", 1.0, 1, "", api_name="/speak_clip")
    assert "samples at 24,000 Hz" in stats


def test_gradio_serves_no_file_outside_its_own_folders(guarded, logged_in):
    _, settings = guarded
    secret = settings.data_dir / "browser-secret"
    assert secret.is_file()
    for path in ["/etc/passwd", str(secret), str(settings.data_dir / "features"), os.path.abspath("app.py")]:
        assert logged_in.get(f"/gradio_api/file={path}").status_code == 403, path


def test_a_recording_named_by_server_path_is_refused(guarded, logged_in, tmp_path):
    outside = tmp_path / "server-side.wav"
    sf.write(outside, 0.3 * np.sin(np.arange(48_000) / 5), 16_000)
    recording = {"path": str(outside), "meta": {"_type": "gradio.FileData"}}
    form = ["Hello there.", "recording", recording, "hello there how are you", 1.0, 1, ""]
    event = logged_in.post("/gradio_api/call/speak_clip", json={"data": form}).json()["event_id"]
    result = logged_in.get(f"/gradio_api/call/speak_clip/{event}").text
    assert "event: error" in result and "it was not uploaded by a user" in result


def test_an_upload_over_the_limit_is_a_413_while_it_is_received(logged_in):
    big = logged_in.post("/gradio_api/upload", files={"files": ("big.wav", b"\0" * (2**20 + 1), "audio/wav")})
    assert big.status_code == 413 and big.text == "File size exceeded maximum allowed size of 1048576 bytes."
    small = logged_in.post("/gradio_api/upload", files={"files": ("small.wav", b"\0" * 2**20, "audio/wav")})
    assert small.status_code == 200


def test_share_is_off_by_default_and_warned_about_more_without_a_login():
    assert parse_settings([]).share is False
    (shared,) = security_warnings(Settings(share=True, api_key=KEY))
    assert "ANYONE with the link can use this app" in shared and "There is NO LOGIN" in shared
    (shared_with_login,) = security_warnings(Settings(share=True, auth=LOGIN, api_key=KEY))
    assert "ANYONE" in shared_with_login and "NO LOGIN" not in shared_with_login
    assert security_warnings(Settings()) == []


def test_a_login_without_an_api_key_warns_that_the_api_is_open():
    (warning,) = security_warnings(Settings(auth=LOGIN))
    assert warning.startswith("--auth protects the web UI only: /v1/audio/speech is open")


def test_security_flags_and_their_environment_variables(monkeypatch):
    settings = parse_settings(["--auth", "ada:s3cret:with:colons", "--api-key", KEY, "--max-upload-mb", "5"])
    assert (settings.auth, settings.api_key, settings.max_upload_mb) == (LOGIN, KEY, 5)
    assert KEY not in repr(settings) and "s3cret" not in repr(settings)
    monkeypatch.setenv("COSYAPP_AUTH", "bob:pw")
    monkeypatch.setenv("COSYAPP_API_KEY", "env-key")
    monkeypatch.setenv("COSYAPP_MAX_UPLOAD_MB", "7")
    settings = parse_settings([])
    assert (settings.auth, settings.api_key, settings.max_upload_mb) == (("bob", "pw"), "env-key", 7)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--auth", "nocolon"], "--auth must be USER:PASSWORD"),
        (["--auth", ":pw"], "--auth must be USER:PASSWORD"),
        (["--api-key", " "], "--api-key must not be empty"),
        (["--max-upload-mb", "0"], "--max-upload-mb must be at least 1"),
    ],
)
def test_bad_security_flags_exit_with_a_message(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_settings(flags)
    assert message in capsys.readouterr().err
