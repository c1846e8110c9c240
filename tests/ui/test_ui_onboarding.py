"""Cloning a voice in one step on the page, in headless Chromium: upload or record a prompt, see the
clip that will be used, get its transcript filled in (the demo server's recogniser), save the voice.
Phone and browser formats through the page decode to the WAV's samples within the codec's tolerance
(tests/test_prompt_formats.py states it)."""

import io
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from test_prompt_formats import FORMATS, MIN_SNR_DB, at_16k, convert
from test_ui_browser import finished_stats, open_app, speak

from cosyapp.frontend.audio import PromptAudio
from cosyapp.web.ui.prompt import DEMO_NOTE

REPO = Path(__file__).resolve().parents[2]
AISHELL = REPO / "assets" / "voices" / "zh-aishell-w0121.wav"
ENGLISH = REPO / "assets" / "voices" / "en-espeak-us.wav"
DEMO_MARK = DEMO_NOTE.split("**")[1]  # "demo speech recogniser"


def open_own_voice(page, ui):
    open_app(page, ui)
    page.locator("#own-voice").get_by_text("Your own voice").click()


def upload(page, path):
    """Upload ``path`` as the prompt, clearing the one the player holds first (as a person would)."""
    clear = page.locator("#recording button[aria-label=Clear]")
    if clear.count():
        clear.click()
    page.locator("#recording input[type=file]").set_input_files(path)


def upload_other_format(page, path):
    """Upload ``path`` with the button for recordings in video containers (.webm, .mp4, ...)."""
    with page.expect_file_chooser() as chooser:
        page.locator("#upload-other").click()
    chooser.value.set_files(path)


def box(page):
    return page.locator("#prompt-text textarea")


def prepared_note(page, previous: str = "") -> str:
    """The preview's note once it shows a new "Using ..." line (after ``previous``)."""
    script = (
        "() => { const t = document.querySelector('#prompt-prepared').innerText;"
        " return t.slice(t.indexOf('Using')); }"
    )
    # The note as the wait saw it (without the progress timer Gradio may show beside it): read again
    # afterwards, it may already be the next upload's, half written.
    found = page.wait_for_function(
        f"(old) => {{ const t = ({script})(); return t.startsWith('Using') && t !== old && t; }}",
        arg=previous,
        timeout=30_000,
    )
    return found.json_value()


def filled_transcript(page, previous: str = "") -> str:
    page.wait_for_function(
        "(old) => { const v = document.querySelector('#prompt-text textarea').value;"
        " return v !== '' && v !== old; }",
        arg=previous,
        timeout=30_000,
    )
    return box(page).input_value()


def preview_link(page, previous: str = "") -> str:
    """The preview player's download link once it names a new clip (after ``previous``)."""
    page.wait_for_function(
        "(old) => { const a = document.querySelector('#prompt-preview a.download-link');"
        " return a && a.href && a.href !== old; }",
        arg=previous,
        timeout=30_000,
    )
    return page.locator("#prompt-preview a.download-link").get_attribute("href")


def preview_samples(ui, link: str) -> np.ndarray:
    """The previewed clip behind ``link``, at 16 kHz."""
    samples, rate = sf.read(io.BytesIO(ui.fetch(link)), dtype="float32")
    return at_16k(PromptAudio(samples, rate))


def test_an_upload_with_an_empty_transcript_is_filled_in_and_saves(page, ui):
    open_own_voice(page, ui)
    assert box(page).input_value() == ""
    upload(page, AISHELL)
    assert prepared_note(page).startswith("Using 3.5 s (0.4-3.8 s of 4.2 s): silence trimmed")
    assert page.locator("#voice input").input_value().startswith("The recording below")
    assert filled_transcript(page)
    page.get_by_text(DEMO_MARK).first.wait_for(timeout=10_000)
    page.locator("#voice-name textarea, #voice-name input").first.fill("Filled in for me")
    page.locator("#save-voice").click()
    page.get_by_text("Saved “Filled in for me”").first.wait_for(timeout=30_000)
    assert page.locator("#voice input").input_value() == "Filled in for me (yours)"


def test_an_edited_transcript_is_kept_and_an_automatic_one_is_replaced(page, ui):
    open_own_voice(page, ui)
    upload(page, AISHELL)
    first_note = prepared_note(page)
    automatic = filled_transcript(page)
    upload(page, ENGLISH)  # the box still holds the automatic transcript: it is replaced
    second_note = prepared_note(page, first_note)
    assert filled_transcript(page, automatic) != automatic
    box(page).fill("My own words for this recording")
    upload(page, AISHELL)
    prepared_note(page, second_note)
    time.sleep(3)  # the transcription step runs (and is skipped) after the preview
    assert box(page).input_value() == "My own words for this recording"


@pytest.mark.parametrize("suffix", FORMATS)
def test_a_compressed_upload_previews_the_samples_of_its_wav(page, ui, tmp_path, suffix):
    open_own_voice(page, ui)
    upload(page, AISHELL)
    prepared_note(page)
    link = preview_link(page)
    reference = preview_samples(ui, link)
    # The audio upload takes audio/* files (.m4a); browsers call .mp4 and .webm video.
    (upload if suffix == "m4a" else upload_other_format)(page, convert(AISHELL, tmp_path, suffix))
    samples = preview_samples(ui, preview_link(page, link))  # the new upload's preview: its note below
    assert prepared_note(page).startswith("Using 3.5 s")
    assert page.locator("#voice input").input_value().startswith("The recording below")
    assert abs(len(samples) - len(reference)) <= 320  # trimming decides on 10 ms frames
    best = max(
        10 * np.log10(np.sum(reference[:n] ** 2) / np.sum((reference[:n] - shifted[:n]) ** 2))
        for lag in (-160, 0, 160)
        for shifted in [np.roll(samples, lag)]
        for n in [min(len(reference), len(samples))]
    )
    assert best >= MIN_SNR_DB[suffix]


@pytest.fixture
def microphone_page(playwright, browser_type_launch_args):
    """A page whose microphone plays the AISHELL recording (Chromium's fake capture device)."""
    fake = [
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={AISHELL}",
    ]
    args = browser_type_launch_args | {"args": [*browser_type_launch_args["args"], *fake]}
    browser = playwright.chromium.launch(**args)
    context = browser.new_context(permissions=["microphone"])
    yield context.new_page()
    context.close()
    browser.close()


def test_a_recording_made_in_the_browser_is_prepared_transcribed_and_speaks(microphone_page, ui):
    page = microphone_page
    open_own_voice(page, ui)
    page.locator("#recording button[aria-label='Record audio']").click()
    page.locator("#recording button.record-button").click()
    time.sleep(4)
    page.locator("#recording button.stop-button").first.click()
    note = prepared_note(page)
    assert note.startswith("Using ")
    assert filled_transcript(page)
    assert page.locator("#voice input").input_value().startswith("The recording below")
    speak(page, "你好。")
    seconds, samples, rate = finished_stats(page)
    assert samples > 0 and rate == 24_000
