"""The web UI and the HTTP API of one served app (mounted as in production, uvicorn on loopback)
answer the same request the same way: the same message for the same mistake, nothing of the
internals for a bug, and the same audio bytes for the same clip."""

import io
import os
import wave

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from test_server import make_service, wait_until

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

from cosyapp.web.api_errors import INTERNAL_ERROR  # noqa: E402
from cosyapp.web.ui.events import INTERNAL_ERROR as UI_INTERNAL_ERROR  # noqa: E402

MAX_CHARS = 60
GOOD = {"input": "Hello there.", "voice": "en-espeak-us", "speed": 1.0, "seed": 4, "response_format": "wav"}
MAX_SEED = 2**63 - 1
BUG = "CUDA error: device-side assert triggered in /opt/secret/kernel.cu"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return make_service(tmp_path_factory, max_text_chars=MAX_CHARS)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def ui(url):
    client = Client(url, download_files=False, verbose=False)
    yield client
    client.close()


def api_error(http, **changes) -> tuple[int, dict]:
    response = http.post("/v1/audio/speech", json={**GOOD, **changes})
    return response.status_code, response.json()["error"]


def ui_form(input: str, voice: str, speed: float, seed: int | None, response_format: str = "wav") -> tuple:
    """The page's form (text, voice, recording, transcript, speed, seed, session) of an API body
    (the page's clips are WAV: it has no format field)."""
    return input, voice, None, "", speed, seed, ""


def ui_error(ui, api_name: str, **changes) -> str:
    with pytest.raises(AppError) as raised:
        ui.predict(*ui_form(**{**GOOD, **changes}), api_name=api_name)
    return str(raised.value)


@pytest.mark.parametrize(
    "changes, status, param, message",
    [
        ({"speed": 3.0}, 400, "speed", "Speed must be between 0.5 and 2.0, got 3.0."),
        ({"speed": 0.25}, 400, "speed", "Speed must be between 0.5 and 2.0, got 0.25."),
        ({"seed": -1}, 400, "seed", f"The seed must be a whole number from 0 to {MAX_SEED}, got -1."),
        ({"input": ""}, 400, "input", "The text is empty: type what the voice should say."),
        ({"input": " \n\t"}, 400, "input", "The text is empty: type what the voice should say."),
        (
            {"input": "a" * (MAX_CHARS + 1)},
            400,
            "input",
            f"The text is {MAX_CHARS + 1} characters long; the limit is {MAX_CHARS}. "
            "Shorten it or send it in parts.",
        ),
        ({"voice": "nobody"}, 404, "voice", "Voice 'nobody' not found; pick one of the listed voices."),
    ],
)
@pytest.mark.parametrize("api_name", ["/speak", "/speak_clip"])
def test_the_same_mistake_gets_the_same_message_in_the_ui_and_the_api(
    http, ui, api_name, changes, status, param, message
):
    code, error = api_error(http, **changes)
    assert (code, error["param"], error["message"]) == (status, param, message)
    assert ui_error(ui, api_name, **changes) == message


def test_a_bug_is_a_500_without_internals_and_a_generic_toast(http, ui, service, monkeypatch, caplog):
    async def broken(request):
        raise RuntimeError(BUG)
        yield  # an async generator, as the LM engine's

    monkeypatch.setattr(service.pipeline.lm, "generate", broken)
    for stream in (False, True):
        response = http.post("/v1/audio/speech", json={**GOOD, "stream": stream})
        assert response.status_code == 500
        assert response.json() == {
            "error": {"message": INTERNAL_ERROR, "type": "server_error", "param": None, "code": None}
        }
        assert "CUDA" not in response.text and "Traceback" not in response.text
    for api_name in ("/speak", "/speak_clip"):
        assert ui_error(ui, api_name) == UI_INTERNAL_ERROR
    # Each failure is logged with its exception (and so its traceback), in full.
    logged = sorted((r.name, str(r.exc_info[1])) for r in caplog.records if r.exc_info)
    assert logged == [("cosyapp.web.api_errors", BUG)] * 2 + [("cosyapp.web.ui.events", BUG)] * 2
    monkeypatch.undo()
    assert http.post("/v1/audio/speech", json=GOOD).status_code == 200  # the server serves on


def test_the_api_and_the_ui_give_identical_wav_bytes_for_the_same_clip(http, ui, url):
    api = http.post("/v1/audio/speech", json=GOOD)
    assert api.status_code == 200
    _, _, file = ui.predict(*ui_form(**GOOD), api_name="/speak_clip")
    downloaded = httpx.get(file["url"], timeout=60).content
    with wave.open(io.BytesIO(api.content)) as reader:
        assert reader.getnframes() > 0
    assert downloaded == api.content


LONG = "今天天气很好。我们去公园散步吧。然后回家吃饭。晚上一起看电影。明天早上再去跑步。"


@pytest.mark.parametrize("sessions, clients", [(["", ""], 2), (["tab-a", "tab-a"], 1)])
def test_fair_admission_keys_streams_by_page_session_else_by_gradio_session(url, service, sessions, clients):
    """Two gradio_client Clients are two Gradio sessions; the same page session from both is one client."""
    health = service.pipeline.health
    callers = [Client(url, download_files=False, verbose=False) for _ in sessions]  # two Gradio sessions
    jobs = [
        caller.submit(LONG, "zh-aishell-w0121", None, "", 1.0, 1, session, api_name="/speak")
        for caller, session in zip(callers, sessions, strict=True)
    ]
    try:
        wait_until(lambda: health()["active_streams"] == 2, timeout=60)
        assert health()["clients"] == clients
    finally:
        for job in jobs:
            job.cancel()
        for caller in callers:
            caller.close()
    wait_until(lambda: health()["active_streams"] == 0)
