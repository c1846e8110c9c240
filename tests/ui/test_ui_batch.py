"""Bad values in a Gradio batch of whole clips: the app on the tiny model (tests/ui/conftest.py), called
as API users call it. Each bad request gets its own message and every good one its audio, whoever
shares its batch; alone or on the streaming endpoint, a bad value is a readable AppError."""

import io
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf
from gradio_client import Client
from gradio_client.exceptions import AppError
from gradio_client.utils import Status

from cosyapp.web.ui.events import batch_failure

MAX_SEED = 2**63 - 1
BATCH = re.compile(r"whole clip in a batch of \*\*(\d+)\*\*")
SAMPLES = re.compile(r"\(([\d,]+) samples at 24,000 Hz\)")
# Long enough to keep both whole-clip workers busy (8 s alone on 2 CPU cores) while the calls
# under test join the queue, so the next free worker takes them as one batch.
BLOCKER = "The birch canoe slid on the smooth planks, and the boy was there when the sun rose. " * 10
URL_MESSAGE = (
    "Upload the recording instead of naming it by URL: the server fetches no files "
    "(gradio_client: handle_file(a local path))."
)


def form(
    text="Hello there.", voice="en-espeak-us", recording=None, prompt_text="", speed=1.0, seed=0
) -> list:
    """The form of /speak and /speak_clip: text, voice, recording, transcript, speed, seed, session."""
    return [text, voice, recording, prompt_text, speed, seed, ""]


def file_at(path: str) -> dict:
    """A file value naming ``path`` as Gradio's file data does (gradio_client uploads local paths
    given this way, but sends URLs as they are)."""
    return {"path": path, "meta": {"_type": "gradio.FileData"}}


# name: (form, the message its request must get)
BAD = {
    "speed above the range": (form(speed=3.0), "Speed must be between 0.5 and 2.0, got 3.0."),
    "negative seed": (form(seed=-1), f"The seed must be a whole number from 0 to {MAX_SEED}, got -1."),
    "huge seed": (form(seed=2**64), f"The seed must be a whole number from 0 to {MAX_SEED}, got {2**64}."),
    "text too long": (
        form(text="a" * 5001),
        "The text is 5,001 characters long; the limit is 5,000. Shorten it or send it in parts.",
    ),
    "unknown voice": (form(voice="nobody"), "Voice 'nobody' not found; pick one of the listed voices."),
    "speed as a word": (form(speed="fast"), "Speed must be between 0.5 and 2.0, got 'fast'."),
    "seed as a string": (form(seed="7"), f"The seed must be a whole number from 0 to {MAX_SEED}, got '7'."),
    "text as a number": (form(text=42), "The text must be a string, got 42."),
    "voice as a list": (form(voice=["en-espeak-us"]), "The voice must be a string, got ['en-espeak-us']."),
    "recording as a bare path": (
        form(voice="recording", recording="/etc/passwd", prompt_text="hello"),
        "The recording must be an uploaded file (gradio_client: handle_file(path)) or null, "
        "got '/etc/passwd'.",
    ),
    "recording by URL": (
        form(voice="recording", recording=file_at("http://127.0.0.1:9/voice.wav"), prompt_text="hello"),
        URL_MESSAGE,
    ),
}
GOOD_SEEDS = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def client(ui):
    return Client(ui.url, download_files=False, verbose=False)


@pytest.fixture
def outside(tmp_path) -> str:
    """A real recording on the server's disk, outside Gradio's upload folder."""
    path = tmp_path / "server-side.wav"
    sf.write(path, 0.3 * np.sin(np.arange(48_000) / 5), 16_000)
    return str(path)


def wait_for(jobs: list, status: Status, timeout: float = 120) -> None:
    """Wait until every job has reached ``status`` or ended."""
    deadline = time.monotonic() + timeout
    while not all(job.done() or job.status().code == status for job in jobs):
        assert time.monotonic() < deadline, [job.status().code for job in jobs]
        time.sleep(0.05)


def raw_call(url: str, data: list) -> tuple[str, list | None]:
    """(event, outputs) of a /speak_clip call sent as plain HTTP, which names files as it likes."""
    with httpx.Client(base_url=url, timeout=300) as http:
        event = http.post("gradio_api/call/speak_clip", json={"data": data}).json()["event_id"]
        answer = http.get(f"gradio_api/call/speak_clip/{event}").text
    # Server-sent events; heartbeats may come before the answer
    kind, _, payload = answer.strip().split("\n\n")[-1].partition("\ndata: ")
    return kind.removeprefix("event: "), json.loads(payload)


def failure(result) -> tuple[str, int]:
    """(message, batch size) of a whole clip that failed inside a batch: no audio, no file."""
    player, stats, file = result
    assert player is None and file is None, result
    match = re.fullmatch(r"\*\*Failed:\*\* (.*) · whole clip in a batch of \*\*(\d+)\*\*", stats, re.S)
    assert match, stats
    assert batch_failure(stats) == match[1]  # what the bench and soak tools read
    return match[1], int(match[2])


def test_bad_values_in_a_batch_fail_only_their_own_requests(client, ui, outside):
    blockers = []
    for seed in (1, 2):  # one after the other, or Gradio may run them as one batch on one worker
        blockers.append(client.submit(*form(BLOCKER, seed=seed), api_name="/speak_clip"))
        wait_for(blockers, Status.PROCESSING)
    with ThreadPoolExecutor(len(BAD) + len(GOOD_SEEDS) + 1) as pool:
        foreign = form(voice="recording", recording=file_at(outside), prompt_text="hello there how are you")
        raw = pool.submit(raw_call, ui.url, foreign)
        calls = [values for values, _ in BAD.values()] + [form(seed=seed) for seed in GOOD_SEEDS]
        jobs = list(pool.map(lambda values: client.submit(*values, api_name="/speak_clip"), calls))
        wait_for(jobs, Status.IN_QUEUE)
        ended = [(job.status().code, job.exception()) for job in blockers + jobs if job.done()]
        assert not ended, f"ended before the batch gathered (the blockers first): {ended}"
        results = [job.result(timeout=300) for job in jobs]
        raw_kind, raw_outputs = raw.result(timeout=300)
    for blocker in blockers:
        blocker.result(timeout=300)

    batches = []
    for (name, (_, message)), result in zip(BAD.items(), results, strict=False):
        got, batch = failure(result)
        assert got == message, name
        batches.append(batch)
    assert raw_kind == "complete"
    got, batch = failure(raw_outputs)
    assert got.startswith("Only files uploaded to this server can be used: upload the recording first")
    assert f"Cannot move {outside} to the gradio cache dir because it was not uploaded by a user." in got
    batches.append(batch)
    for seed, (player, stats, file) in zip(GOOD_SEEDS, results[len(BAD) :], strict=True):
        assert player is not None and file is not None, (seed, stats)
        samples, rate = sf.read(io.BytesIO(ui.fetch(file["url"])), dtype="float32")
        assert rate == 24_000 and len(samples) == int(SAMPLES.search(stats)[1].replace(",", "")) > 0
        batches.append(int(BATCH.search(stats)[1]))
    print(f"batch size seen by each call (bad ones, the raw one, then the good ones): {batches}")
    assert min(batches) > 1, batches
    assert ui.service.pipeline.metrics.snapshot()["clip_max_batch_size"] >= max(batches)


@pytest.mark.parametrize("api_name", ["/speak", "/speak_clip"])
@pytest.mark.parametrize(
    "name", ["speed as a word", "text as a number", "recording as a bare path", "recording by URL"]
)
def test_a_bad_value_alone_is_a_readable_app_error(client, api_name, name):
    values, message = BAD[name]
    with pytest.raises(AppError) as raised:
        client.predict(*values, api_name=api_name)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize("count", [6, 8])
def test_a_request_with_the_wrong_number_of_values_is_refused_when_it_joins_the_queue(client, ui, count):
    # Gradio lines a batch up value by value and cuts every request to the shortest one, so this
    # request would fail its whole batch if it joined one.
    fn_index = next(
        i for i, dep in enumerate(client.config["dependencies"]) if dep["api_name"] == "speak_clip"
    )
    values = (form() + [""])[:count]
    body = {"data": values, "fn_index": fn_index, "session_hash": "wrong-count"}
    with httpx.Client(base_url=ui.url, timeout=60) as http:
        answer = http.post("gradio_api/queue/join", json=body)
    assert (answer.status_code, answer.json()) == (
        400,
        {"detail": f"This endpoint takes 7 values, got {count}."},
    )


def test_a_voice_event_refuses_a_file_that_was_not_uploaded_with_a_readable_message(client, ui, outside):
    # The page's recording check runs when a recording arrives; a hand-made call can name any path.
    dependencies = client.config["dependencies"]
    recording_id = next(
        c["id"] for c in client.config["components"] if c["props"].get("elem_id") == "recording"
    )
    fn_index = next(i for i, dep in enumerate(dependencies) if dep["inputs"] == [recording_id])  # the check
    body = {"data": [file_at(outside)], "fn_index": fn_index, "session_hash": "voice-event"}
    with httpx.Client(base_url=ui.url, timeout=60) as http:
        assert http.post("gradio_api/queue/join", json=body).status_code == 200
        answer = http.get("gradio_api/queue/data", params={"session_hash": "voice-event"}).text
    completed = json.loads(next(line for line in answer.splitlines() if "process_completed" in line)[6:])
    assert completed["success"] is False
    assert completed["output"]["error"].startswith("Only files uploaded to this server can be used")
