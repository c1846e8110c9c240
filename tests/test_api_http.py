"""HTTP hygiene of the API: 405 with Allow, JSON 404s, CORS only when allowed, X-Request-Id, and a
graceful stop on SIGTERM (app.py in its own process)."""

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import LONG, SHORT, VOICE, make_service, serving, wait_until

from cosyapp.web.server import build_app

ROOT = Path(__file__).resolve().parents[1]
ORIGIN = "https://reader.example"


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    with (
        serving(build_app(make_service(tmp_path_factory))) as base,
        httpx.Client(base_url=base, timeout=120) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def cors_http(tmp_path_factory):
    service = make_service(tmp_path_factory, cors_origins=(ORIGIN,))
    with serving(build_app(service)) as base, httpx.Client(base_url=base, timeout=120) as client:
        yield client


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("GET", "/v1/audio/speech", "POST"),
        ("PUT", "/v1/audio/speech", "POST"),
        ("OPTIONS", "/v1/audio/speech", "POST"),
        ("PUT", "/v1/audio/voices", "GET, POST"),
        ("POST", "/v1/audio/voices/some-voice", "DELETE, GET"),
        ("POST", "/health", "GET"),
        ("DELETE", "/metrics", "GET"),
    ],
)
def test_a_wrong_method_is_a_405_naming_the_allowed_ones(http, method, path, allow):
    response = http.request(method, path)
    assert response.status_code == 405 and response.headers["allow"] == allow
    assert response.json()["error"] == {
        "message": f"Method {method} is not allowed on {path}; use {allow}.",
        "type": "invalid_request_error",
        "param": None,
        "code": "method_not_allowed",
    }


def test_an_unknown_api_path_is_a_json_404(http):
    response = http.post("/v1/chat/completions", json={})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "No API endpoint at /v1/chat/completions."


def test_plain_http_to_the_websocket_endpoint_says_to_use_a_websocket(http):
    response = http.get("/v1/audio/speech/stream")
    assert response.status_code == 426 and response.headers["upgrade"] == "websocket"
    assert "WebSocket endpoint" in response.json()["error"]["message"]


def test_every_api_answer_carries_a_request_id_that_the_log_names(http, caplog):
    caplog.set_level(logging.INFO, logger="cosyapp.web.request_ids")
    ids = set()
    for response in [
        http.get("/health"),
        http.get("/v1/audio/voices"),
        http.post("/v1/audio/speech", json={"input": "", "voice": VOICE}),
        http.get("/v1/audio/speech"),
        http.post("/v1/audio/speech", json={"input": SHORT, "voice": VOICE}),
    ]:
        request_id = response.headers["x-request-id"]
        assert len(request_id) == 32 and request_id not in ids
        ids.add(request_id)
    assert ids <= {record.getMessage().split()[1].rstrip(":") for record in caplog.records}


def test_a_clients_own_request_id_is_kept_when_it_is_a_plain_token(http):
    assert http.get("/health", headers={"x-request-id": "job-42.a_b"}).headers["x-request-id"] == "job-42.a_b"
    replaced = http.get("/health", headers={"x-request-id": "bad id;" + "x" * 70}).headers["x-request-id"]
    assert len(replaced) == 32


def test_cors_is_off_by_default(http):
    preflight = http.options(
        "/v1/audio/speech", headers={"origin": ORIGIN, "access-control-request-method": "POST"}
    )
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in http.get("/health", headers={"origin": ORIGIN}).headers


def test_cors_origins_let_those_browsers_call_the_api(cors_http):
    preflight = cors_http.options(
        "/v1/audio/speech",
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    speech = cors_http.post(
        "/v1/audio/speech", json={"input": SHORT, "voice": VOICE}, headers={"origin": ORIGIN}
    )
    assert speech.status_code == 200 and speech.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in speech.headers["access-control-expose-headers"].lower()
    other = cors_http.options(
        "/v1/audio/speech",
        headers={"origin": "https://other.example", "access-control-request-method": "POST"},
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_lets_running_requests_finish_then_cancels_the_rest_and_exits_0(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    port, timeout_s = free_port(), 8.0
    log_path = root / "sigterm.log"
    with open(log_path, "w") as log_file:
        server = subprocess.Popen(
            [sys.executable, "app.py", "--demo", "--engine", "torch", "--device", "cpu", "--port", str(port)]
            + ["--shutdown-timeout", str(timeout_s), "--cache-dir", str(root / "cache")]
            + ["--data-dir", str(root / "sigterm-data")],
            cwd=ROOT,
            env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its text process too is ended if the test fails
        )
    base = f"http://127.0.0.1:{port}"
    results: dict[str, object] = {}

    def finishing() -> None:
        results["finishing"] = httpx.post(
            f"{base}/v1/audio/speech", json={"input": LONG, "voice": VOICE}, timeout=60
        )

    def endless() -> None:
        # About 100 sentences: minutes of speech, still running when the shutdown timeout ends even
        # on a quiet machine (880 characters were done in 8 s there).
        body = {"input": LONG * 100, "voice": VOICE, "stream": True, "response_format": "pcm"}
        try:
            with httpx.stream("POST", f"{base}/v1/audio/speech", json=body, timeout=60) as response:
                results["endless bytes"] = sum(len(piece) for piece in response.iter_raw())
        except httpx.HTTPError as error:  # cut off by the shutdown
            results["endless error"] = error

    try:
        wait_until(lambda: _serving(base), timeout=300)
        threads = [threading.Thread(target=endless), threading.Thread(target=finishing)]
        threads[0].start()
        wait_until(lambda: httpx.get(f"{base}/health").json()["active_streams"] == 1, timeout=60)
        threads[1].start()
        wait_until(lambda: httpx.get(f"{base}/health").json()["active_streams"] == 2, timeout=60)
        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(1.0)
        with pytest.raises(httpx.ConnectError):  # no longer admitting
            httpx.get(f"{base}/health", timeout=5)
        code = server.wait(timeout=timeout_s + 60)
        stopped = time.monotonic() - signalled
        for thread in threads:
            thread.join(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever of the server is left
            os.killpg(server.pid, signal.SIGKILL)
    log = log_path.read_text()
    assert code == 0, log[-3000:]
    assert timeout_s - 1 < stopped < timeout_s + 30, stopped  # waited for the endless one, then cancelled it
    assert results["finishing"].status_code == 200 and len(results["finishing"].content) > 44
    assert "endless error" in results or results["endless bytes"] > 0
    assert "Cancel 1 running task(s)" in log and "engines stopped" in log


def _serving(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
