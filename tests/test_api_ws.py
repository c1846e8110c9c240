"""WebSocket /v1/audio/speech/stream: text deltas in, each sentence's audio out as soon as it is complete.

The server runs the endless tiny model (every sentence decodes its maximum of tokens), so a text's
audio length depends only on its text tokens, and can be compared with the same text sent whole.
"""

import asyncio
import json
import time

import httpx
import pytest
from test_api_disconnect import endless_service, idle
from test_server import VOICE, wait_until
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

SENTENCES = ["Hello there.", "How are you today?", "I am fine, thanks.", "See you soon!"]
TEXT = " ".join(SENTENCES)
SAMPLES_PER_TOKEN = 960  # 24 kHz audio, 25 speech tokens per second
STOPS_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return endless_service(tmp_path_factory)


def pcm_samples(url: str, text: str) -> int:
    body = {"input": text, "voice": VOICE, "seed": 1, "stream": True, "response_format": "pcm"}
    response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=300)
    assert response.status_code == 200
    return len(response.content) // 2


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/audio/speech/stream"


async def converse(url: str, deltas: list[str], pause_s: float, **start) -> dict:
    """Send a start, ``deltas`` ``pause_s`` apart, then end; collect what the server sends."""
    got: dict = {"events": [], "audio": b"", "first_audio_at": None}
    async with connect(ws_url(url), max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "voice": VOICE, "seed": 1, **start}))

        async def send() -> None:
            for delta in deltas:
                await ws.send(json.dumps({"type": "text", "text": delta}))
                await asyncio.sleep(pause_s)
            got["last_delta_at"] = time.monotonic()
            await ws.send(json.dumps({"type": "end"}))

        sender = asyncio.create_task(send())
        async for message in ws:
            if isinstance(message, bytes):
                got["first_audio_at"] = got["first_audio_at"] or time.monotonic()
                got["audio"] += message
            else:
                got["events"].append(json.loads(message))
        await sender
        got["close_code"] = ws.close_code
    return got


def test_audio_starts_before_the_text_ends_in_order_and_as_long_as_the_text_sent_whole(url, service):
    deltas = [TEXT[i : i + 3] for i in range(0, len(TEXT), 3)]
    got = asyncio.run(converse(url, deltas, pause_s=0.15, response_format="pcm"))
    assert got["close_code"] == 1000
    assert got["first_audio_at"] < got["last_delta_at"]  # the first sentence spoke while text came in
    events = got["events"]
    assert events[0]["type"] == "ready" and events[0]["sample_rate"] == 24_000
    starts = [e for e in events if e["type"] == "sentence.start"]
    ends = [e for e in events if e["type"] == "sentence.end"]
    assert [e["text"] for e in starts] == SENTENCES
    assert [e["index"] for e in starts] == [e["index"] for e in ends] == [0, 1, 2, 3]
    assert [e["type"] for e in events[1:]] == ["sentence.start", "sentence.end"] * 4 + ["done"]
    samples = len(got["audio"]) // 2
    assert events[-1] == {"type": "done", "sentences": 4, "samples": samples}
    assert sum(e["samples"] for e in ends) == samples
    # Each sentence is a request of its own: as long as that sentence sent whole; and the text sent
    # whole differs by at most a speech token a sentence (the space a sentence starts with joins
    # its first word's text token there).
    assert samples == sum(pcm_samples(url, sentence) for sentence in SENTENCES)
    assert abs(samples - pcm_samples(url, TEXT)) <= SAMPLES_PER_TOKEN * len(SENTENCES)
    wait_until(lambda: idle(service))


def test_the_next_sentence_is_made_while_the_current_one_is_sent(url, service):
    """A connection has its next sentence in flight beside the one it sends, never more."""
    in_flight: list[int] = []
    done = False

    def watch() -> None:
        while not done:
            in_flight.append(service.pipeline.health()["active_streams"])
            time.sleep(0.005)

    async def main():
        nonlocal done
        watcher = asyncio.create_task(asyncio.to_thread(watch))
        try:
            return await converse(url, [TEXT], pause_s=0, response_format="pcm")
        finally:
            done = True
            await watcher

    got = asyncio.run(main())
    assert got["events"][-1]["sentences"] == 4
    assert max(in_flight) == 2
    wait_until(lambda: idle(service))


def test_the_binary_frames_form_one_file_of_the_format(url):
    got = asyncio.run(converse(url, [TEXT[:40], TEXT[40:]], pause_s=0, response_format="wav"))
    assert got["audio"].startswith(b"RIFF") and got["audio"].count(b"RIFF") == 1
    assert got["events"][-1]["samples"] == (len(got["audio"]) - 44) // 2


async def refused(url: str, *messages) -> tuple[int, dict]:
    """Send ``messages`` (str for JSON text, bytes as binary); the close code and the error event."""
    async with connect(ws_url(url)) as ws:
        for message in messages:
            await ws.send(message)
        received = []
        with pytest.raises(ConnectionClosed):
            while True:
                received.append(await asyncio.wait_for(ws.recv(), 120))
    errors = [json.loads(m) for m in received if isinstance(m, str) and '"error"' in m]
    return ws.close_code, errors[-1]["error"]


START = json.dumps({"type": "start", "voice": VOICE})


@pytest.mark.parametrize(
    "messages, code, words",
    [
        ([b"\x00\x01"], 1003, "binary frames"),
        (["{not json"], 1007, "not valid JSON"),
        (["[1, 2]"], 1007, "JSON object"),
        ([json.dumps({"type": "text", "text": "Hi."})], 1008, "first message must be"),
        ([json.dumps({"type": "start", "voice": "nobody"})], 1008, "Voice 'nobody' not found"),
        ([json.dumps({"type": "start", "voice": VOICE, "speed": 9.0})], 1008, "Speed must be between"),
        ([json.dumps({"type": "start", "voice": VOICE, "temperature": 1})], 1008, "Extra inputs"),
        (
            [json.dumps({"type": "start", "voice": VOICE, "instructions": "x" * 201})],
            1008,
            "the limit is 200",
        ),
        ([START, json.dumps({"type": "shout"})], 1008, "Unknown message 'shout'"),
        ([START, json.dumps({"type": "text", "text": "x" * 6000})], 1009, "at most 5000 characters"),
    ],
)
def test_bad_messages_close_with_a_clear_code_and_leave_no_work(url, service, messages, code, words):
    close_code, error = asyncio.run(refused(url, *messages))
    assert close_code == code and words in error["message"], error
    wait_until(lambda: idle(service), timeout=5)


def test_a_client_vanishing_mid_sentence_stops_its_work(url, service):
    async def vanish() -> None:
        ws = await connect(ws_url(url))
        await ws.send(START)
        await ws.send(json.dumps({"type": "text", "text": TEXT * 4 + " And more"}))
        while not isinstance(await ws.recv(), bytes):
            pass
        ws.transport.abort()  # no close frame: the connection just drops

    wait_until(lambda: idle(service))
    asyncio.run(vanish())
    gone = time.monotonic()
    wait_until(lambda: idle(service), timeout=30)
    # The 17 sentences would take minutes on the endless model. The stop waits at most for the
    # engine steps in flight, under a second on an idle machine; the bound leaves room for a loaded
    # one (how fast is the benchmarks' business, that it stops is this test's).
    assert time.monotonic() - gone < STOPS_WITHIN_S
    tokens = service.pipeline.lm.stats().tokens_generated
    time.sleep(0.3)
    assert service.pipeline.lm.stats().tokens_generated == tokens  # the LM decodes nothing more for it
