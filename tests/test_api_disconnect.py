"""No work outlives its client: a speech request whose client hangs up stops within a second.

The server runs an endless tiny model (its sentences never stop early), so every request is still
being synthesised when its client leaves. After the hang-up, the request's stream slot is free, the
LM engine has dropped the request (nothing running, no more tokens decoded) and the token2wav
worker has no queued job left, within 1 s; the metrics count the request as cancelled.
"""

import json
import socket
import time

import httpx
import pytest
from test_server import VOICE, make_service, requests_total, wait_until

from cosyapp.modelgen.tiny import write_random_model

TEXT = "Hello there, how are you today? I am fine, thanks. " * 8  # minutes of audio on the endless model
STOPS_WITHIN_S = 1.0


def endless_service(tmp_path_factory):
    """A service on the endless tiny model (the other tests of API work import it from here).

    Its own data folder: in the shared one, voices that earlier tests saved have previews of the demo
    model, which a service on another model makes again in the background whenever its engines are
    idle (previews.py), and on this model each would decode until its token limit, beside the work
    these tests watch stop."""
    folder = write_random_model(tmp_path_factory.mktemp("endless") / "model", seed=2, endless=True)
    data = tmp_path_factory.mktemp("endless-data")
    return make_service(tmp_path_factory, model=str(folder), demo=False, data_dir=data)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return endless_service(tmp_path_factory)


def idle(service) -> bool:
    pipeline = service.pipeline
    return (
        pipeline.health()["active_streams"] == 0
        and pipeline.lm.stats().running == 0
        and pipeline.token2wav.stats().queue_depth == 0
    )


def send_speech(url: str, **body) -> socket.socket:
    """A raw connection that has sent a speech request (the client can then vanish at any moment)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps({"input": TEXT, "voice": VOICE, "seed": 1, **body}).encode()
    head = (
        f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    connection = socket.create_connection((host, int(port)))
    connection.sendall(head.encode() + data)
    return connection


def hang_up_and_time_the_stop(service, connection: socket.socket) -> float:
    """Close ``connection`` while its request runs; seconds until the engines hold none of its work."""
    lm = service.pipeline.lm
    wait_until(lambda: lm.stats().tokens_generated > 0 and lm.stats().running == 1, timeout=60)
    assert service.pipeline.health()["active_streams"] == 1
    connection.close()
    closed = time.monotonic()
    wait_until(lambda: idle(service), timeout=30)
    stopped = time.monotonic() - closed
    tokens = lm.stats().tokens_generated
    time.sleep(0.3)
    assert lm.stats().tokens_generated == tokens  # the LM decodes nothing more for it
    return stopped


@pytest.mark.parametrize(
    "body",
    [{}, {"response_format": "mp3"}, {"stream": True}, {"stream_format": "sse", "response_format": "opus"}],
    ids=["whole-wav", "whole-mp3", "streamed-wav", "sse-opus"],
)
def test_a_client_hanging_up_stops_its_synthesis_within_a_second(url, service, body):
    wait_until(lambda: idle(service))
    before = requests_total_at(url)
    stopped = hang_up_and_time_the_stop(service, send_speech(url, **body))
    assert stopped < STOPS_WITHIN_S, stopped
    after = requests_total_at(url)
    assert after["cancelled"] == before["cancelled"] + 1 and after["done"] == before["done"]


def test_a_request_whose_client_stays_is_not_cut(url, service):
    """The disconnect watch of a whole clip does not fire for a client that waits for its answer."""
    connection = send_speech(url, input="Hello there.")
    connection.settimeout(120)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += connection.recv(65536)
    connection.close()
    assert answer.startswith(b"HTTP/1.1 200 OK")


def requests_total_at(url: str) -> dict[str, float]:
    with httpx.Client(base_url=url, timeout=30) as client:
        return requests_total(client)


@pytest.fixture
def quick_heartbeats(monkeypatch):
    """Gradio notices a closed page when its event stream next wakes: heartbeats every 0.2 s."""
    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.2")


def test_a_page_that_goes_away_stops_its_whole_clip(url, service, quick_heartbeats):
    """A page's whole clip whose event stream disconnects is cancelled once Gradio marks the event
    gone: the engines drop its work and the metrics count it as cancelled. (A streamed event ends at
    its next chunk, when Gradio closes its generator.)"""
    wait_until(lambda: idle(service))
    before = requests_total_at(url)
    form = [TEXT, VOICE, None, "", 1.0, 1, "page-that-goes-away"]
    with httpx.Client(base_url=url, timeout=60) as http:
        event = http.post("/gradio_api/call/speak_clip", json={"data": form}).json()["event_id"]
        with http.stream("GET", f"/gradio_api/call/speak_clip/{event}"):
            lm = service.pipeline.lm
            wait_until(lambda: lm.stats().tokens_generated > 0 and lm.stats().running == 1, timeout=60)
        # The event stream is closed here, as when the tab is closed.
    closed = time.monotonic()
    wait_until(lambda: idle(service), timeout=30)
    stopped = time.monotonic() - closed
    after = requests_total_at(url)
    assert after["cancelled"] == before["cancelled"] + 1 and after["done"] == before["done"]
    assert stopped < 5, stopped  # heartbeat, queue notice and the 0.2 s watch; the clip takes minutes
