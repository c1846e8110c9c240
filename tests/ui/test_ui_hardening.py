"""Bad input through the UI's endpoints (gradio_client, as API users send it) and one toast in the
browser: each gets its readable message (AppError for the client, a toast on the page)."""

import re

import httpx
import numpy as np
import pytest
import soundfile as sf
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from test_ui_browser import open_app, speak, use_recording

TRANSCRIPT = "甚至出现交易几乎停滞的情况"


@pytest.fixture(scope="module")
def client(ui):
    return Client(ui.url, download_files=False, verbose=False)


def form(text="Hello there.", voice="en-espeak-us", recording=None, prompt_text="", speed=1.0, seed=0):
    return text, voice, recording, prompt_text, speed, seed, ""


def with_recording(path, prompt_text=TRANSCRIPT) -> tuple:
    return form(voice="recording", recording=handle_file(str(path)), prompt_text=prompt_text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("\x00\x1b", "The text is empty: type what the voice should say."),
        ("!!! ???", "The text has nothing to read aloud: it has no letters or digits"),
        ("🎉👍🏽", "The text has nothing to read aloud: it has no letters or digits"),
        ("Привет, мир", "The text is written in a script this model cannot read (Cyrillic)."),
        ("a" * 5001, "The text is 5,001 characters long; the limit is 5,000. Shorten it or send it"),
    ],
)
def test_bad_text_is_a_readable_error(client, text, message):
    with pytest.raises(AppError, match=re.escape(message)):
        client.predict(*form(text=text), api_name="/speak_clip")


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_seed_out_of_range_is_refused(client, seed):
    with pytest.raises(AppError, match="The seed must be a whole number from 0 to"):
        client.predict(*form(seed=seed), api_name="/speak")


@pytest.mark.parametrize("seed, shown", [(b"NaN", "nan"), (b"Infinity", "inf")])
def test_a_non_finite_seed_in_raw_json_gets_the_seed_rule_and_the_app_serves_on(client, ui, seed, shown):
    # JSON encoders refuse NaN, but the server parses these literals, so a hand-made request can send
    # one; the seed field hands it on unrounded and the request rules answer it.
    body = b'{"data": ["Hello there.", "en-espeak-us", null, "", 1.0, ' + seed + b', ""]}'
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=ui.url, timeout=60) as http:
        event = http.post("gradio_api/call/speak_clip", content=body, headers=headers).json()["event_id"]
        answer = http.get(f"gradio_api/call/speak_clip/{event}").text
    assert answer.startswith("event: error\n")
    assert f"The seed must be a whole number from 0 to 9223372036854775807, got {shown}." in answer
    _, stats, _ = client.predict(*form(seed=3), api_name="/speak_clip")
    assert "samples at 24,000 Hz" in stats


def test_a_fractional_seed_is_rounded_by_the_number_field(client, ui):
    _, rounded, _ = client.predict(*form(seed=2.4), api_name="/speak_clip")
    _, whole, _ = client.predict(*form(seed=2), api_name="/speak_clip")
    assert rounded.split(" · ")[-1] == whole.split(" · ")[-1]  # same audio length for the same seed


def test_an_unknown_voice_is_a_readable_error(client):
    with pytest.raises(AppError, match=re.escape("Voice '../../etc/passwd' not found; pick one")):
        client.predict(*form(voice="../../etc/passwd"), api_name="/speak_clip")


def bad_recordings(folder):
    """(file, message) for each kind of unusable recording, written as real files."""
    t = np.arange(32_000) / 16_000
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    broken = tone.copy()
    broken[100] = np.nan
    files = {
        "empty.wav": (None, "The recording is empty: the file has no content."),
        "silent.wav": ((np.zeros(32_000, np.float32), 16_000), "The recording is silent"),
        "short.wav": ((tone[:8_000], 16_000), "The recording is too short (0.50 s)"),
        "low.wav": ((tone, 8_000), "The recording's sample rate is 8000 Hz"),
        "nan.wav": ((broken, 16_000), "The recording is damaged: some samples are not numbers"),
    }
    for name, (audio, message) in files.items():
        if audio is None:
            (folder / name).write_bytes(b"")
        else:
            sf.write(folder / name, audio[0], audio[1], subtype="FLOAT")
        yield folder / name, message


def test_each_unusable_recording_gets_its_own_message(client, tmp_path):
    for path, message in bad_recordings(tmp_path):
        with pytest.raises(AppError, match=re.escape(message)):
            client.predict(*with_recording(path), api_name="/speak")


def test_a_transcript_that_cannot_be_the_recordings_is_refused(client, recording):
    path, transcript = recording
    with pytest.raises(AppError, match="The transcript is too long for the recording"):
        client.predict(*with_recording(path, transcript * 5), api_name="/speak_clip")
    with pytest.raises(AppError, match="Type what is said in the recording"):
        client.predict(*with_recording(path, " \n "), api_name="/speak_clip")


def test_a_mismatched_transcript_shows_a_toast_in_the_page(page, ui, recording):
    path, transcript = recording
    open_app(page, ui)
    use_recording(page, path, transcript * 5)
    speak(page, "你好。")
    toast = page.get_by_text(re.compile("The transcript is too long for the recording"))
    toast.first.wait_for(timeout=15_000)
    assert "type exactly what is said in this recording" in toast.first.inner_text()
    assert "Traceback" not in page.content()
