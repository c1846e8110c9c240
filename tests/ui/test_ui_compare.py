"""Compare on the page (headless Chromium) and through /compare (gradio_client), on the tiny model:
one text in several voices at once, served together by the shared engines, each row's audio the
clip its voice makes alone."""

import io
import re
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from gradio_client import Client
from gradio_client.exceptions import AppError
from test_ui_browser import open_app

from cosyapp.web.ui.compare import MAX_ROWS

TEXT = "今天天气很好。我们去公园散步吧。"
LONG_TEXT = "今天天气很好。我们去公园散步吧。然后回家吃饭。晚上一起看电影。明天早上再去跑步。" * 3
VOICES = ["en-espeak-us", "en-espeak-gb", "zh-aishell-w0121"]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
BATCHES = re.compile(r"LM up to (\d+) requests, flow up to (\d+) chunks")
STATS = re.compile(r"TTFA ([\d.]+) s · RTF ([\d.]+) · audio ([\d.]+) s \(([\d,]+) samples at 24,000 Hz\)")


def compare_values(rows: list[tuple], text: str = TEXT, seed: int | None = 5) -> list:
    """/compare's values: text, recording, transcript, speed, seed, session, then per row
    voice, mode, instruction (unused rows: no voice)."""
    rows = rows + [("", "zero_shot", "")] * (MAX_ROWS - len(rows))
    return [text, None, "", 1.0, seed, "", *(value for row in rows for value in row)]


@pytest.fixture(scope="module")
def client(ui):
    return Client(ui.url, download_files=False, verbose=False)


def open_compare(page, ui) -> None:
    open_app(page, ui)
    page.locator("#compare").get_by_text("Compare voices").click()
    page.locator("#compare-go").wait_for(state="visible")


def choose(page, row: int, voice_label: str) -> None:
    page.locator(f"#compare-voice-{row} input").click()
    page.locator(f"#compare-voice-{row}").get_by_role("option", name=voice_label, exact=True).click()
    page.locator(f"#compare-voice-{row} input").press("Escape")


def wait_done(page, row: int, timeout: float = 120_000) -> None:
    page.wait_for_function(
        "(sel) => document.querySelector(sel).dataset.done === 'true'",
        arg=f"#compare-player-{row} .cosy-player",
        timeout=timeout,
    )


def saved_wav(page, row: int, folder: Path) -> np.ndarray:
    """The row's clip as its player's Download WAV button saves it (16-bit samples at 24 kHz)."""
    with page.expect_download() as download:
        page.locator(f"#compare-player-{row} .cp-download").click()
    path = folder / f"row-{row}.wav"
    download.value.save_as(path)
    samples, rate = sf.read(path, dtype="int16")
    assert rate == 24_000
    return samples


def alone(client, ui, voice: str, text: str = TEXT, seed: int = 5) -> np.ndarray:
    """The voice's clip made alone: /speak with the same text and seed, its WAV file."""
    *_, file = client.predict(text, voice, None, "", 1.0, seed, "", api_name="/speak")
    samples, rate = sf.read(io.BytesIO(ui.fetch(file["url"])), dtype="int16")
    assert rate == 24_000
    return samples


def test_compare_of_three_voices_gives_three_clips_from_one_engine_batch_each_as_made_alone(
    page, ui, client, tmp_path
):
    open_compare(page, ui)
    page.locator("#text textarea").fill(TEXT)
    page.locator("#seed input").fill("5")
    labels = {info.id: info.name for info in ui.service.voices.list_voices(None)}
    for row, voice in enumerate(VOICES, start=1):
        choose(page, row, labels[voice])
    assert page.locator("#compare-voice-4 input").input_value() == "— not used —"
    deadline = time.monotonic() + 30
    while ui.service.pipeline.health()["active_streams"] and time.monotonic() < deadline:
        time.sleep(0.1)  # what an earlier test left running would join the engines' batches
    page.locator("#compare-go").click()
    for row in (1, 2, 3):
        wait_done(page, row)
    summary = page.locator("#compare-summary").inner_text()
    lm, flow = map(int, BATCHES.search(summary).groups())
    print(f"compare summary: {summary}")
    # Nothing else runs: the three rows were decoded in the same LM steps (3 requests) and shared
    # token2wav steps (their chunks arrive in step with the LM, so 2 or 3 share a flow call).
    assert lm == 3 and flow >= 2, summary
    clips = [saved_wav(page, row, tmp_path) for row in (1, 2, 3)]
    for row, clip in enumerate(clips, start=1):
        stats = STATS.search(page.locator(f"#compare-stats-{row}").inner_text().replace("*", ""))
        assert stats, page.locator(f"#compare-stats-{row}").inner_text()
        assert int(stats[4].replace(",", "")) == len(clip) > 24_000
        assert float(stats[1]) > 0 and float(stats[2]) > 0
    assert not page.locator("#compare-player-4").is_visible()  # row 4 has no voice
    for voice, clip in zip(VOICES, clips, strict=True):
        made_alone = alone(client, ui, voice)
        assert len(clip) == len(made_alone), voice
        # The suite's batched-against-alone tolerance (1e-5) in 16-bit samples: rounding flips by 1.
        assert np.abs(clip.astype(int) - made_alone).max() <= 1, voice
    assert not np.array_equal(clips[0][: len(clips[1])], clips[1][: len(clips[0])])


def finished_by_mode(ui, mode: str) -> int:
    return sum(n for (name, _), n in ui.service.pipeline.metrics.by_mode.items() if name == mode)


def test_rows_in_different_modes_each_reach_the_engine_in_their_mode(page, ui):
    open_compare(page, ui)
    page.locator("#text textarea").fill("今天天气真不错。")
    before = {mode: finished_by_mode(ui, mode) for mode in ("zero_shot", "instruct2", "cross_lingual")}
    assert not page.locator("#compare-instruction-2").is_visible()  # Clone takes no instruction
    for row, label in ((2, "Instruct"), (3, "Cross-lingual")):
        page.locator(f"#compare-mode-{row} input").click()
        page.locator(f"#compare-mode-{row}").get_by_role("option", name=label, exact=True).click()
    page.locator("#compare-instruction-2 textarea").fill("用四川话说这句话")
    page.locator("#compare-go").click()
    for row in (1, 2, 3):
        wait_done(page, row)
    after = {mode: finished_by_mode(ui, mode) for mode in before}
    assert after == {mode: count + 1 for mode, count in before.items()}


def test_a_voice_saved_on_the_page_can_be_compared(page, ui, recording):
    path, transcript = recording
    open_compare(page, ui)
    page.locator("#own-voice").get_by_text("Your own voice").click()
    page.locator("#recording input[type=file]").set_input_files(path)
    page.locator("#prompt-text textarea").fill(transcript)
    page.wait_for_function(
        "() => document.querySelector('#voice input').value.startsWith('The recording below')", timeout=15_000
    )
    page.locator("#voice-name textarea, #voice-name input").first.fill("Compared voice")
    page.locator("#save-voice").click()
    page.get_by_text("Saved “Compared voice”").first.wait_for(timeout=30_000)
    choose(page, 1, "Compared voice (yours)")
    page.locator("#compare-go").click()
    wait_done(page, 1)
    assert STATS.search(page.locator("#compare-stats-1").inner_text().replace("*", ""))


def test_stop_ends_every_rows_stream(page, ui):
    health = ui.service.pipeline.health
    open_compare(page, ui)
    page.locator("#text textarea").fill(LONG_TEXT)
    page.locator("#compare-go").click()
    page.wait_for_function(
        "() => [1, 2, 3].every((i) => Number("
        "document.querySelector(`#compare-player-${i} .cosy-player`).dataset.received || 0) > 0)",
        timeout=120_000,
    )
    assert health()["active_streams"] == 3
    page.locator("#compare-stop").click()
    deadline = time.monotonic() + 10
    while health()["active_streams"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health()["active_streams"] == 0
    for row in (1, 2, 3):
        player = page.locator(f"#compare-player-{row} .cosy-player")
        assert player.get_attribute("data-state") == "stopped"
        assert player.get_attribute("data-done") == "false"


def test_a_bad_row_fails_only_its_own_player(client):
    rows = [
        ("en-espeak-us", "zero_shot", ""),
        ("zh-aishell-w0121", "instruct2", ""),
        ("nobody", "zero_shot", ""),
        ("en-espeak-gb", "cross_lingual", ""),
    ]
    *players, s1, s2, s3, s4, summary = client.predict(*compare_values(rows), api_name="/compare")
    assert players[1] is None and players[2] is None
    assert s2.startswith("**Failed:** The instruction is empty"), s2
    assert s3 == "**Failed:** Voice 'nobody' not found; pick one of the listed voices.", s3
    for player, stats in ((players[0], s1), (players[3], s4)):
        assert player["done"] and player["chunks"], stats
        assert STATS.search(stats.replace("*", "")), stats
    assert summary.startswith("2 voices at once"), summary


def test_a_shared_field_or_no_voice_refuses_the_whole_compare(client):
    with pytest.raises(AppError, match="Speed must be between 0.5 and 2.0, got 3.0."):
        values = compare_values([("en-espeak-us", "zero_shot", "")])
        values[3] = 3.0
        client.predict(*values, api_name="/compare")
    with pytest.raises(AppError, match="Pick a voice in at least one row to compare."):
        client.predict(*compare_values([]), api_name="/compare")
    with pytest.raises(AppError, match="Compare speaks the text: the mode must be one of"):
        client.predict(*compare_values([("en-espeak-us", "vc", "")]), api_name="/compare")


def test_a_busy_server_refuses_the_whole_compare(ui):
    admission = ui.service.pipeline.admission
    started = ui.service.pipeline.metrics.snapshot()["requests"]
    others = [Client(ui.url, download_files=False, verbose=False) for _ in range(6)]
    jobs = [
        other.submit(LONG_TEXT, "en-espeak-us", None, "", 1.0, seed, "", api_name="/speak")
        for seed, other in enumerate(others)
    ]
    try:
        deadline = time.monotonic() + 60
        while admission.active < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert admission.active == 6  # 2 of the 8 streams free
        rows = [(voice, "zero_shot", "") for voice in VOICES]
        busy = "The server is busy: comparing 3 voices needs 3 free streams and 2 are free now"
        page = Client(ui.url, download_files=False, verbose=False)
        with pytest.raises(AppError, match=busy):
            page.predict(*compare_values(rows), api_name="/compare")
        assert ui.service.pipeline.metrics.snapshot()["requests"] == started + 6  # no row started
    finally:
        for job in jobs:
            job.cancel()


def test_compare_at_phone_width(browser, ui):
    page = browser.new_page(viewport={"width": 390, "height": 844})
    try:
        open_compare(page, ui)
        page.locator("#text textarea").fill("Hello from the compare screenshot.")
        page.locator("#compare-go").click()
        for row in (1, 2, 3):
            wait_done(page, row)
        overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow} px wider than a 390 px screen"
        for row in (1, 2, 3):
            box = page.locator(f"#compare-player-{row} .cosy-player").bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= 390, box
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / "compare-phone.png"
        page.locator("#compare").screenshot(path=path)
        assert path.stat().st_size > 10_000
    finally:
        page.context.close()
