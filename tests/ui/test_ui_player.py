"""The page's streaming player in headless Chromium: raw PCM through Gradio's queue, played by an
AudioWorklet. The worklet reports every clip sample it writes to the output
(``window.cosyappCapturePlayback``), so the tests compare what the page played with the download; the
fallback for pages without AudioWorklet reports every chunk it schedules."""

import base64
import io
import threading
import time
from contextlib import contextmanager

import gradio as gr
import numpy as np
import soundfile as sf
from conftest import free_port
from gradio.utils import diff
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from test_ui_browser import open_app

from cosyapp.codec import pcm16
from cosyapp.web.ui.player import PlayerFeed, stop_players_js, stream_player

# Four chunks from the tiny model (first chunk, then 2 s, 4 s and the rest), seconds apart on a CPU.
LONG_TEXT = "今天天气很好。我们去公园散步吧。然后回家吃饭。晚上一起看电影。明天早上再去跑步。"
TEXT = "今天天气很好。我们去公园散步吧。"
PLAYER = "#player .cosy-player"


# A page where AudioWorklet is missing, as on plain http from another host (not a secure context).
NO_WORKLET = "Object.defineProperty(BaseAudioContext.prototype, 'audioWorklet', { get: () => undefined })"


def open_player(page, ui):
    """The app with its session open and the player's audio output made (the worklet module loaded,
    or the fallback), so a Generate click is timed and heard from the first chunk."""
    page.add_init_script("window.cosyappCapturePlayback = true")
    open_app(page, ui)
    page.wait_for_function("(sel) => document.querySelector(sel)?.dataset.output", arg=PLAYER, timeout=30_000)


def generate(page, text: str, seed: int) -> None:
    page.locator("#text textarea").fill(text)
    page.locator("#seed input").fill(str(seed))
    page.locator("#generate").click()


def report(page) -> dict:
    return page.evaluate("(sel) => document.querySelector(sel).cosyPlayer.report()", PLAYER)


def wait_for_state(page, *states: str, timeout: float = 60_000) -> None:
    """Wait until the player is in one of ``states``; a timeout fails with what the player saw (its
    report: state, chunks, audio context) and the page's console errors."""
    try:
        page.wait_for_function(
            "([sel, states]) => states.includes(document.querySelector(sel).dataset.state)",
            arg=[PLAYER, list(states)],
            timeout=timeout,
        )
    except PlaywrightTimeout:
        seen = report(page)
        seen["arrivals"] = [[None if at is None else round(at), n] for at, n in seen["arrivals"]]
        raise AssertionError(
            f"the player never reached {states} in {timeout / 1000:.0f} s: {seen}; "
            f"console errors: {getattr(page, 'console_errors', [])}"
        ) from None


def played_samples(page) -> np.ndarray:
    captured = page.evaluate("(sel) => document.querySelector(sel).cosyPlayer.captured()", PLAYER)
    return np.frombuffer(base64.b64decode(captured), "<i2")


def downloaded_samples(page, ui) -> np.ndarray:
    link = page.locator("#download a").first
    link.wait_for(timeout=30_000)
    samples, rate = sf.read(io.BytesIO(ui.fetch(link.get_attribute("href"))), dtype="int16")
    assert rate == 24_000
    return samples


def test_each_yield_sends_only_the_new_chunk_through_gradios_diff():
    feed = PlayerFeed(24_000)
    first = feed.add(np.full(480, 0.25, np.float32), ttfa=0.2)
    second = feed.add(np.full(960, -0.5, np.float32), ttfa=0.2)
    chunk = base64.b64encode(pcm16(np.full(960, -0.5, np.float32))).decode()
    assert diff(first, second) == [["add", ["chunks", 1], chunk]]
    assert diff(second, feed.value(done=True)) == [["replace", ["done"], True]]
    assert np.frombuffer(base64.b64decode(first["chunks"][0]), "<i2").tolist() == [8192] * 480


def test_the_player_starts_before_the_stream_ends(page, ui):
    open_player(page, ui)
    generate(page, LONG_TEXT, seed=1)
    wait_for_state(page, "ended")
    seen = report(page)
    assert seen["clickToSound"] is not None and seen["serverTtfa"] is not None, seen
    arrivals = [round(at) for at, _ in seen["arrivals"]]
    print(f"click to sound {seen['clickToSound']:.0f} ms, TTFA {seen['serverTtfa']:.0f} ms, at {arrivals}")
    assert len(arrivals) >= 3, seen
    assert seen["clickToSound"] < arrivals[-1], seen  # heard while later chunks were still being made
    assert 0 < seen["serverTtfa"] < seen["clickToSound"], seen


def test_the_page_plays_every_sample_once_in_order(page, ui):
    open_player(page, ui)
    generate(page, TEXT, seed=2)
    wait_for_state(page, "ended")
    played, clip = played_samples(page), downloaded_samples(page, ui)
    assert len(clip) > 24_000 and len(report(page)["arrivals"]) >= 2
    assert len(played) == len(clip) and report(page)["output"] == "worklet"
    assert np.array_equal(played, clip)


def test_without_audioworklet_the_scheduled_fallback_plays_every_sample_once_in_order(page, ui):
    page.add_init_script(NO_WORKLET)
    open_player(page, ui)
    generate(page, TEXT, seed=2)
    wait_for_state(page, "ended")
    seen = report(page)
    played, clip = played_samples(page), downloaded_samples(page, ui)
    assert seen["output"] == "scheduled" and len(seen["arrivals"]) >= 2
    assert 0 < seen["serverTtfa"] < seen["clickToSound"]
    assert len(played) == len(clip) > 24_000
    assert np.array_equal(played, clip)


def test_stop_cancels_the_server_work_and_the_playback(page, ui):
    health = ui.service.pipeline.health
    open_player(page, ui)
    generate(page, LONG_TEXT, seed=3)
    wait_for_state(page, "playing", "buffering")
    assert health()["active_streams"] == 1
    page.locator("#stop").click()
    wait_for_state(page, "stopped", timeout=5_000)
    for _ in range(50):
        if health()["active_streams"] == 0:
            break
        page.wait_for_timeout(100)
    assert health()["active_streams"] == 0
    position = report(page)["played"]
    page.wait_for_timeout(600)
    assert report(page)["played"] == position  # nothing more is played
    assert report(page)["done"] is False  # the stream never finished


@contextmanager
def one_player_app(stopped: threading.Event):
    """A page with only a streaming player, a Go button that streams a tone chunk by chunk for 30 s
    (``stopped`` is set once the stream's generator is closed) and a Stop button that cancels it. The
    player's own ``stop_on`` matches nothing on the page: only the Stop event's js can stop it."""

    def tone():
        feed = PlayerFeed(24_000)
        try:
            for _ in range(60):
                yield feed.add(np.full(12_000, 0.1, np.float32), ttfa=0.05)
                time.sleep(0.5)
        finally:
            stopped.set()

    with gr.Blocks() as demo:
        player = stream_player(24_000, start_on="#go", stop_on="#nothing-here", elem_id="lone")
        go, halt = gr.Button("Go", elem_id="go"), gr.Button("Stop", elem_id="halt")
        streaming = go.click(tone, None, player)
        halt.click(None, None, None, cancels=[streaming], queue=False, js=stop_players_js("lone"))
    port = free_port()
    demo.queue().launch(server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def test_the_stop_buttons_event_stops_the_players_it_names(page):
    stopped = threading.Event()
    with one_player_app(stopped) as url:
        page.goto(url)
        lone = "#lone .cosy-player"
        made = "(sel) => document.querySelector(sel)?.dataset.output"
        page.wait_for_function(made, arg=lone, timeout=30_000)
        page.locator("#go").click()
        page.wait_for_function(
            "(sel) => ['playing', 'buffering'].includes(document.querySelector(sel).dataset.state)", arg=lone
        )
        page.locator("#halt").click()
        page.wait_for_function("(sel) => document.querySelector(sel).dataset.state === 'stopped'", arg=lone)
        assert stopped.wait(10)  # and the server's stream was cancelled


def test_two_pages_at_once_each_hear_their_own_audio(browser, ui):
    pages = [browser.new_page(), browser.new_page()]
    try:
        for page in pages:
            open_player(page, ui)
        for seed, page in enumerate(pages, start=4):
            generate(page, TEXT, seed=seed)
        played = []
        for page in pages:
            wait_for_state(page, "ended")
            played.append(played_samples(page))
            assert np.array_equal(played[-1], downloaded_samples(page, ui))
        n = min(len(played[0]), len(played[1]))
        assert n > 24_000 and np.abs(played[0][:n].astype(int) - played[1][:n]).mean() > 10
    finally:
        for page in pages:
            page.context.close()
