"""The page's modes in headless Chromium (Clone / Cross-lingual / Instruct / Convert tabs, presets,
tag buttons) and its /speak_mode endpoint through gradio_client, on the tiny model."""

import io
import re

import numpy as np
import pytest
import soundfile as sf
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from test_ui_browser import open_app

from cosyapp.frontend.source import source_tokens

SOURCE = "assets/voices/en-espeak-us.wav"
STATS = re.compile(r"audio ([\d.]+) s \(([\d,]+) samples at ([\d,]+) Hz\)")
SAMPLES_PER_TOKEN = 960  # 2 mel frames of 480 samples per source speech token


def pick_mode(page, label: str) -> None:
    page.get_by_role("tab", name=label).click()
    page.locator("#generate-mode").wait_for(state="visible", timeout=10_000)


def finished_samples(page) -> int:
    """The samples of the finished request, from the stats line under the player."""
    page.wait_for_function(
        "() => { const t = document.querySelector('#stats').innerText;"
        " return t.includes('samples') && !t.includes('streaming'); }",
        timeout=120_000,
    )
    found = STATS.search(page.locator("#stats").inner_text().replace("*", ""))
    assert found, page.locator("#stats").inner_text()
    assert found[3] == "24,000"
    return int(found[2].replace(",", ""))


def downloaded(page, ui) -> np.ndarray:
    link = page.locator("#download a").first
    link.wait_for(timeout=30_000)
    samples, rate = sf.read(io.BytesIO(ui.fetch(link.get_attribute("href"))), dtype="int16")
    assert rate == 24_000
    return samples


def finished_by_mode(ui, mode: str) -> int:
    return sum(n for (name, _), n in ui.service.pipeline.metrics.by_mode.items() if name == mode)


def test_cross_lingual_tab_streams_the_text_in_the_chosen_voice(page, ui):
    open_app(page, ui)
    before = finished_by_mode(ui, "cross_lingual")
    pick_mode(page, "Cross-lingual")
    assert not page.locator("#generate").is_visible()
    assert not page.locator("#streaming").is_visible()  # every mode but Clone streams
    page.locator("#text textarea").fill("The weather is lovely today.")
    page.locator("#generate-mode").click()
    samples = finished_samples(page)
    assert samples > 0 and len(downloaded(page, ui)) == samples
    assert finished_by_mode(ui, "cross_lingual") == before + 1


def test_instruct_preset_fills_the_instruction_and_speaks_with_it(page, ui):
    open_app(page, ui)
    before = finished_by_mode(ui, "instruct2")
    pick_mode(page, "Instruct")
    page.locator("#mode-instruct2").get_by_role("button", name="粤语", exact=True).click()
    assert page.locator("#instruction textarea").input_value() == "用粤语说这句话"
    page.locator("#mode-instruct2").get_by_role("button", name="Whisper", exact=True).click()
    assert page.locator("#instruction textarea").input_value() == "Speak softly, in a whisper."
    page.locator("#text textarea").fill("今天天气真不错。")
    page.locator("#generate-mode").click()
    assert finished_samples(page) > 0
    assert finished_by_mode(ui, "instruct2") == before + 1


def test_tag_buttons_insert_at_the_cursor_and_wrap_the_selection(page, ui):
    open_app(page, ui)
    box = page.locator("#text textarea")
    box.fill("Hello world, nice day.")
    box.evaluate("(el) => el.setSelectionRange(5, 5)")
    page.locator("#tag-buttons").get_by_role("button", name="[laughter]").click()
    page.wait_for_function("() => document.querySelector('#text textarea').value.includes('[laughter]')")
    assert box.input_value() == "Hello[laughter] world, nice day."
    # the caret goes back after the tag once Gradio has rendered the new value
    page.wait_for_function("() => document.querySelector('#text textarea').selectionStart === 15")
    start = box.input_value().index("nice")
    box.evaluate("(el, start) => el.setSelectionRange(start, start + 4)", start)
    page.locator("#tag-buttons").get_by_role("button", name="<strong>").click()
    page.wait_for_function("() => document.querySelector('#text textarea').value.includes('strong')")
    assert box.input_value() == "Hello[laughter] world, <strong>nice</strong> day."
    page.wait_for_timeout(300)  # the caret is put back after Gradio renders the new value
    caret = box.evaluate("(el) => el.selectionStart")
    assert caret == len("Hello[laughter] world, <strong>nice</strong>")
    # the counter follows the inserted text
    assert page.locator("#char-counter").inner_text().startswith(f"{len(box.input_value())} /")


def test_convert_tab_streams_an_uploaded_recording_in_the_chosen_voice(page, ui):
    open_app(page, ui)
    pick_mode(page, "Convert")
    assert not page.locator("#text textarea").is_visible()  # conversion speaks the recording, not text
    page.locator("#source-speech input[type=file]").set_input_files(SOURCE)
    page.locator("#source-speech audio").first.wait_for(state="attached", timeout=30_000)  # uploaded
    page.locator("#generate-mode").click()
    samples = finished_samples(page)
    tokens = source_tokens(ui.service.voices.frontend, SOURCE)
    assert samples == SAMPLES_PER_TOKEN * len(tokens)
    assert len(downloaded(page, ui)) == samples


@pytest.fixture(scope="module")
def client(ui):
    return Client(ui.url, download_files=False, verbose=False)


def speak_mode(client, mode: str, instruction: str = "", source=None, text: str = "Hello world."):
    return client.predict(
        text, "en-espeak-us", None, "", 1.0, 1, "", mode, instruction, source, api_name="/speak_mode"
    )


@pytest.mark.parametrize(
    ("instruction", "message"),
    [
        ("", "The instruction is empty: say how to speak"),
        ("慢" * 201, "The instruction is 201 characters long; the limit is 200."),
        ("用粤语说<|endofprompt|>", "Leave &lt;|endofprompt|&gt; out of the instruction"),  # toasts escape
    ],
)
def test_speak_mode_answers_a_bad_instruction_with_its_own_message(client, instruction, message):
    with pytest.raises(AppError, match=re.escape(message)):
        speak_mode(client, "instruct2", instruction)


def test_speak_mode_refuses_an_unknown_mode_and_a_conversion_without_a_recording(client):
    with pytest.raises(AppError, match=re.escape("Unknown mode 'sing'; use one of: zero_shot")):
        speak_mode(client, "sing")
    with pytest.raises(AppError, match="Voice conversion needs the speech to convert"):
        speak_mode(client, "vc")


def test_speak_mode_uses_only_the_chosen_modes_inputs(client, ui):
    """The page keeps every tab's inputs: an instruction and a recording left in other tabs are not
    part of a cross-lingual request."""
    before = finished_by_mode(ui, "cross_lingual")
    _, stats, file = speak_mode(client, "cross_lingual", "用粤语说这句话", handle_file(SOURCE))
    assert file is not None and "samples" in stats
    assert finished_by_mode(ui, "cross_lingual") == before + 1


@pytest.mark.parametrize(
    ("seconds", "level", "message"),
    [
        (2.0, 0.0, "The recording is silent (peak level below -60 dBFS)"),
        (0.5, 0.3, "The recording is too short (0.50 s): the speech to convert needs at least 1 s"),
    ],
)
def test_a_conversion_source_that_cannot_be_converted_says_why(client, tmp_path, seconds, level, message):
    noise = level * np.random.default_rng(0).standard_normal(int(24_000 * seconds))
    path = tmp_path / "source.wav"
    sf.write(path, noise.astype(np.float32), 24_000)
    with pytest.raises(AppError, match=re.escape(message)):
        speak_mode(client, "vc", source=handle_file(str(path)))
