"""The page in headless Chromium, as a person uses it: upload a voice, speak, stop, save voices."""

import io
import re
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

SHORT_TEXT = "你好。"  # ~3 s of audio from the tiny model in well under a second
LONG_TEXT = "今天天气很好。我们去公园散步吧。然后回家吃饭。晚上一起看电影。明天早上再去跑步。"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
STATS = re.compile(r"audio \*{0,2}([\d.]+) s\*{0,2} \(([\d,]+) samples at ([\d,]+) Hz\)")


def open_app(page, ui, query: str = ""):
    """Load the app and return once demo.load has opened its session (it fills the session id and
    the voice list; until then a saved voice would go to no session). The page marks <html> then,
    so no fixed sleep guesses how long that takes on a loaded machine. The page's console errors
    are kept in ``page.console_errors`` for failure messages."""
    page.console_errors = []
    page.on("console", lambda message: message.type == "error" and page.console_errors.append(message.text))
    page.goto(ui.url + query)
    page.wait_for_function("() => document.documentElement.dataset.cosySession === 'open'", timeout=60_000)
    page.wait_for_selector("#live-stats")


def use_recording(page, path: Path, transcript: str, usable: bool = True):
    """Upload a prompt recording; a usable one becomes the selected voice once the server checked it."""
    page.locator("#own-voice").get_by_text("Your own voice").click()
    page.locator("#recording input[type=file]").set_input_files(path)
    page.locator("#prompt-text textarea").fill(transcript)
    if usable:
        page.wait_for_function(
            "() => document.querySelector('#voice input').value.startsWith('The recording below')",
            timeout=15_000,
        )


def speak(page, text: str, seed: int | None = None):
    page.locator("#text textarea").fill(text)
    if seed is not None:
        page.locator("#seed input").fill(str(seed))
    page.locator("#generate:visible, #generate-clip:visible").click()


def wait_until_playing(page, timeout: float = 30_000) -> None:
    """Until the streaming player has played 50 ms (its worklet reports the position)."""
    page.wait_for_function(
        "() => document.querySelector('#player .cosy-player').cosyPlayer.report().played > 1200",
        timeout=timeout,
    )


def finished_stats(page) -> tuple[float, int, int]:
    """(seconds, samples, rate) from the stats line once the request has finished."""
    page.wait_for_function(
        "() => { const t = document.querySelector('#stats').innerText;"
        " return t.includes('samples') && !t.includes('streaming'); }",
        timeout=60_000,
    )
    found = STATS.search(page.locator("#stats").inner_text().replace("*", ""))
    assert found, page.locator("#stats").inner_text()
    return float(found[1]), int(found[2].replace(",", "")), int(found[3].replace(",", ""))


def downloaded_clip(page, ui) -> tuple[np.ndarray, int]:
    link = page.locator("#download a").first
    link.wait_for(timeout=30_000)
    samples, rate = sf.read(io.BytesIO(ui.fetch(link.get_attribute("href"))), dtype="float32")
    return samples, rate


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_streaming_from_an_uploaded_recording_plays_and_the_download_matches_the_stats(page, ui, recording):
    open_app(page, ui)
    use_recording(page, *recording)
    clicked = time.monotonic()
    speak(page, SHORT_TEXT)
    wait_until_playing(page)
    browser_ttfa = time.monotonic() - clicked
    seconds, samples, rate = finished_stats(page)
    clip, clip_rate = downloaded_clip(page, ui)
    print(f"browser click-to-sound {browser_ttfa:.2f} s; {page.locator('#stats').inner_text()}")
    assert (clip_rate, len(clip)) == (rate, samples) == (24_000, samples)
    assert samples > 0 and samples % 480 == 0
    assert seconds == pytest.approx(samples / rate, abs=0.01)
    assert np.abs(clip).max() > 0


def test_whole_clip_without_streaming_plays_and_downloads(page, ui):
    open_app(page, ui)
    page.locator("#streaming input").uncheck()
    speak(page, SHORT_TEXT, seed=7)
    seconds, samples, rate = finished_stats(page)
    # the whole-clip player is a waveform player: its clock advances while it plays
    page.locator("#clip-player button[aria-label=Pause]").wait_for(timeout=15_000)
    page.wait_for_function(
        "() => document.querySelector('#clip-player time#time').innerText !== '0:00'", timeout=15_000
    )
    clip, clip_rate = downloaded_clip(page, ui)
    assert "batch of" in page.locator("#stats").inner_text()
    assert (clip_rate, len(clip)) == (rate, samples)
    assert samples > 0 and samples % 480 == 0


def test_two_pages_at_once_each_get_their_own_audio(browser, ui):
    pages = [browser.new_page(), browser.new_page()]
    try:
        for page in pages:
            open_app(page, ui)
        for seed, page in enumerate(pages, start=1):
            speak(page, SHORT_TEXT, seed=seed)
        clips = []
        for page in pages:
            wait_until_playing(page)
            _, samples, _ = finished_stats(page)
            clip, _ = downloaded_clip(page, ui)
            assert len(clip) == samples
            clips.append(clip)
        assert len(clips[0]) != len(clips[1]) or not np.array_equal(clips[0], clips[1])
    finally:
        for page in pages:
            page.context.close()


def test_stop_ends_the_stream_and_the_engine_drops_it(page, ui):
    health = ui.service.pipeline.health
    open_app(page, ui)
    speak(page, LONG_TEXT)
    wait_until_playing(page)
    assert health()["active_streams"] == 1
    page.locator("#stop").click()
    assert wait_for(lambda: health()["active_streams"] == 0, timeout=5.0), health()
    page.wait_for_timeout(1000)
    assert "streaming" in page.locator("#stats").inner_text()  # the final stats never came
    assert page.locator("#download a").count() == 0


def test_closing_the_tab_mid_stream_aborts_its_engine_work(browser, ui):
    health = ui.service.pipeline.health
    page = browser.new_page()
    open_app(page, ui)
    speak(page, LONG_TEXT)
    wait_until_playing(page)
    assert health()["active_streams"] == 1
    page.context.close()
    assert wait_for(lambda: health()["active_streams"] == 0, timeout=10.0), health()


def test_a_text_file_named_wav_is_refused_with_a_clear_message(page, ui, tmp_path):
    fake = tmp_path / "my voice.wav"
    fake.write_text("this is not audio at all\n" * 20)
    open_app(page, ui)
    use_recording(page, fake, "whatever", usable=False)
    toast = page.get_by_text(re.compile("Could not read my voice.wav as audio"))
    toast.first.wait_for(timeout=15_000)
    assert "not in a format we can decode" in toast.first.inner_text()
    assert "Traceback" not in page.content()


def test_the_live_panel_changes_while_a_request_runs(page, ui):
    open_app(page, ui)
    done = ui.service.pipeline.metrics.snapshot()["done"]
    speak(page, LONG_TEXT, seed=11)  # five sentences: seconds of work, over a panel refresh
    page.wait_for_function(
        "() => /\\b1\\s+active streams/.test(document.querySelector('#live-stats').innerText)", timeout=15_000
    )
    finished_stats(page)
    page.wait_for_function(
        "(done) => { const t = document.querySelector('#live-stats').innerText;"
        " return /\\b0\\s+active streams/.test(t) && t.includes(`${done} of`); }",
        arg=done + 1,
        timeout=5_000,
    )


def voice_options(page) -> list[str]:
    page.locator("#voice input").click()
    options = page.locator("ul[role=listbox] li")
    options.first.wait_for()
    names = [o.strip().splitlines()[-1] for o in options.all_inner_texts()]  # after the ✓ of the selected
    page.keyboard.press("Escape")
    return names


def test_a_saved_voice_is_listed_in_its_page_and_not_in_another(browser, ui, recording):
    owner, other = browser.new_page(), browser.new_page()
    try:
        open_app(owner, ui)
        open_app(other, ui)
        use_recording(owner, *recording)
        owner.locator("#voice-name textarea, #voice-name input").first.fill("Aishell test voice")
        owner.locator("#save-voice").click()
        owner.get_by_text("Saved “Aishell test voice”").first.wait_for(timeout=30_000)
        assert owner.locator("#voice input").input_value() == "Aishell test voice (yours)"
        assert "Aishell test voice (yours)" in voice_options(owner)
        assert not any("Aishell test voice" in name for name in voice_options(other))
        owner.reload()
        open_app(owner, ui)
        assert "Aishell test voice (yours)" in voice_options(owner)  # the session survives a reload
    finally:
        owner.context.close()
        other.context.close()


def save_voice(page, recording, name: str, shared: bool = False) -> None:
    use_recording(page, *recording)
    page.locator("#voice-name textarea, #voice-name input").first.fill(name)
    if shared:
        page.locator("#voice-shared input").check()
    page.locator("#save-voice").click()
    page.get_by_text(f"Saved “{name}”").first.wait_for(timeout=30_000)


def test_only_the_browser_that_saved_a_voice_can_delete_it(browser, ui, recording):
    owner, other = browser.new_page(), browser.new_page()
    try:
        open_app(owner, ui)
        save_voice(owner, recording, "Team voice to delete", shared=True)
        open_app(other, ui)  # opened after the save: the shared voice is in its list
        other.locator("#voice input").click()
        other.get_by_role("option", name="Team voice to delete (shared)").click()
        other.locator("#own-voice").get_by_text("Your own voice").click()
        other.locator("#delete-voice").click()
        refusal = other.get_by_text("“Team voice to delete” was saved in another browser")
        refusal.first.wait_for(timeout=15_000)
        assert "Team voice to delete" in {v.name for v in ui.service.voices.list_voices(None)}

        assert owner.locator("#voice input").input_value() == "Team voice to delete (shared)"
        owner.locator("#delete-voice").click()
        owner.get_by_text("Deleted “Team voice to delete”.").first.wait_for(timeout=15_000)
        assert not any("Team voice to delete" in name for name in voice_options(owner))
        assert "Team voice to delete" not in {v.name for v in ui.service.voices.list_voices(None)}
    finally:
        owner.context.close()
        other.context.close()


def test_a_built_in_voice_cannot_be_deleted_from_the_page(page, ui):
    open_app(page, ui)
    page.locator("#own-voice").get_by_text("Your own voice").click()
    page.locator("#delete-voice").click()
    page.get_by_text("Pick one of your saved voices to delete").first.wait_for(timeout=15_000)
    assert "en-espeak-us" in {v.id for v in ui.service.voices.list_voices(None)}


@pytest.mark.parametrize(
    ("name", "query", "width"),
    [("light", "", 1280), ("dark", "?__theme=dark", 1280), ("phone", "", 390)],
)
def test_screenshots_of_the_page(browser, ui, name, query, width):
    page = browser.new_page(viewport={"width": width, "height": 900})
    try:
        open_app(page, ui, query)
        speak(page, "Hello from the screenshot.", seed=3)
        finished_stats(page)
        page.wait_for_timeout(1200)  # one more panel tick
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        page.screenshot(path=path, full_page=True)
        assert path.stat().st_size > 10_000
        if width < 500:
            overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"the page is {overflow} px wider than a {width} px screen"
    finally:
        page.context.close()
