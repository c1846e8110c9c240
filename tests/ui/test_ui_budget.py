"""The page says when the audio budget cut the speech: a toast as it happens, and the note in the
stats under the player (engine/budget.py), here on an app whose requests may make 1 s of audio."""

import pytest
from conftest import launched_ui
from gradio_client import Client

LONG = "Hello there. How are you today? Fine thanks, and you? " * 3


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with launched_ui(tmp_path_factory.mktemp("ui-budget"), max_streams=2, max_request_audio_s=1.0) as running:
        yield running.url


def test_a_streamed_request_past_its_budget_ends_with_the_note_in_the_stats(url):
    client = Client(url, download_files=False, verbose=False)
    job = client.submit(LONG, "en-espeak-us", None, "", 1.0, 0, "", api_name="/speak")
    outputs = list(job)
    _, stats, file = outputs[-1]
    assert file and "TTFA" in stats
    assert "The audio stops early: this request reached the server's limit of 1 s of audio" in stats
