"""The benchmark's browser driver against the running page: what it reports is what the page heard."""

import asyncio
import threading

from cosyapp.bench.browser import BrowserDriver
from cosyapp.bench.stats import summarize

TEXT = "今天天气很好。我们去公园散步吧。"  # two chunks or more from the tiny model


def test_the_browser_driver_reports_click_to_sound_beside_the_servers_ttfa(ui):
    results = []

    async def level() -> None:
        driver = BrowserDriver(ui.url, "en-espeak-us", 24_000)
        try:
            await driver.prepare(2)
            results.extend(await driver.send(TEXT, True, [1, 2], lambda: None))
        finally:
            await driver.close()

    # pytest-playwright's sync API owns this thread's event loop: the async driver gets its own thread
    thread = threading.Thread(target=asyncio.run, args=(level(),))
    thread.start()
    thread.join(timeout=300)
    assert len(results) == 2 and all(r.error is None for r in results), results
    for result in results:
        player = result.player
        assert len(result.chunks) >= 2 and result.audio_s > 1.0
        assert 0 < player["server_ttfa_s"] < player["first_chunk_s"] <= player["click_to_sound_s"]
        assert result.chunks[0][0] == player["first_chunk_s"] <= result.total
    summary = summarize(results, wall=1.0)
    assert summary["click_to_sound_p50"] >= summary["server_ttfa_p50"] > 0
    assert summary["player_delay_p50"] is not None and summary["player_underruns"] >= 0
