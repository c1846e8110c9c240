"""The ``browser`` driver: the page itself in headless Chromium, through Playwright.

One page (its own browser context, as a separate visitor) per concurrent user. A level fills each
page's text and seed, clicks every Generate button at once and reads what the page's streaming
player measured (web/ui/static/player.js): when each chunk arrived after the click, click-to-sound
(the click to the first non-silent sample reaching the audio output, from the AudioWorklet), the
server's TTFA as the handler saw it, and the player's own underruns. Streaming only: the whole-clip
player is Gradio's own. Playwright is imported only here.
"""

import asyncio
import os

from cosyapp.bench.stats import RequestResult

PLAYER = "#player .cosy-player"
# Headless Chromium plays audio without a user gesture and without a sound card (a fake output).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
    "--autoplay-policy=no-user-gesture-required",
]
DEBIAN_CHROMIUM = "/usr/bin/chromium"
OUTPUT_MADE = f"Boolean(document.querySelector({PLAYER!r}).dataset.output)"
FINISHED = f"""() => {{
    const player = document.querySelector({PLAYER!r});
    const error = document.querySelector('.toast-body.error');
    return (player && player.dataset.done === 'true') || (error ? error.innerText : false);
}}"""


class BrowserDriver:
    """Pages of the app at ``base_url`` in Chromium (``executable``: a Chromium binary; default
    Debian's when present, else Playwright's own download)."""

    name = "browser"

    def __init__(self, base_url: str, voice_id: str, sample_rate: int, executable: str | None = None):
        self.base_url = base_url
        self.voice_id = voice_id
        self.sample_rate = sample_rate
        if executable is None and os.path.exists(DEBIAN_CHROMIUM):
            executable = DEBIAN_CHROMIUM
        self.executable = executable
        self.playwright = None
        self.browser = None
        self.pages: list = []

    async def prepare(self, clients: int) -> None:
        """Open pages until there are ``clients`` of them, each loaded with the bench voice chosen."""
        if self.browser is None:
            from playwright.async_api import async_playwright

            self.playwright = await async_playwright().start()
            self.browser = await self.playwright.chromium.launch(
                executable_path=self.executable, args=CHROMIUM_ARGS
            )
        while len(self.pages) < clients:
            self.pages.append(await self._open())

    async def _open(self):
        context = await self.browser.new_context()
        page = await context.new_page()
        await page.goto(self.base_url)
        await page.wait_for_selector(PLAYER, timeout=60_000)
        # its script has run (it sets cosyPlayer last, after its click listener): clicks are timed
        await page.wait_for_function(
            f"() => document.querySelector({PLAYER!r}).cosyPlayer !== undefined", timeout=60_000
        )
        # the page's session id arrives with demo.load, which marks <html> when done; the player has
        # made its audio output; the voice is typed as an id (custom values allowed)
        ready = f"() => document.documentElement.dataset.cosySession === 'open' && {OUTPUT_MADE}"
        await page.wait_for_function(ready, timeout=60_000)
        voice = page.locator("#voice input")
        await voice.fill(self.voice_id)
        await voice.press("Enter")
        return page

    async def send(self, text: str, streaming: bool, seeds: list[int], on_done) -> list[RequestResult]:
        """One page per seed clicks Generate, all at once; ``on_done`` is called as each finishes."""
        assert streaming, "the browser driver measures the streaming player only"
        pages = self.pages[: len(seeds)]
        for page, seed in zip(pages, seeds, strict=True):
            await page.locator("#text textarea").fill(text)
            await page.locator("#seed input").fill(str(seed))
        await asyncio.gather(*(page.locator("#generate").click() for page in pages))

        async def one(page) -> RequestResult:
            result = await self._result(page)
            on_done()
            return result

        return list(await asyncio.gather(*(one(page) for page in pages)))

    async def _result(self, page) -> RequestResult:
        finished = await page.wait_for_function(FINISHED, timeout=600_000, polling=50)
        outcome = await finished.json_value()
        if outcome is not True:
            return RequestResult(error=f"the page said: {outcome}")
        # the last samples may still be playing: click-to-sound comes early, underruns until the end
        await page.wait_for_function(
            f"() => ['ended', 'stopped'].includes(document.querySelector({PLAYER!r}).dataset.state)",
            timeout=600_000,
            polling=50,
        )
        seen = await page.evaluate(f"() => document.querySelector({PLAYER!r}).cosyPlayer.report()")
        if any(at is None for at, _ in seen["arrivals"]):  # its clock starts at the click it saw
            return RequestResult(error="the player saw no Generate click, so it timed nothing")
        chunks = [(at / 1000, samples / self.sample_rate) for at, samples in seen["arrivals"]]
        player = {
            "click_to_sound_s": _seconds(seen["clickToSound"]),
            "first_chunk_s": chunks[0][0] if chunks else None,
            "server_ttfa_s": _seconds(seen["serverTtfa"]),
            "underruns": seen["underruns"],
        }
        return RequestResult(chunks=chunks, total=_seconds(seen["doneAt"]), player=player)

    async def close(self) -> None:
        if self.browser is not None:
            await self.browser.close()
            await self.playwright.stop()
        self.browser = self.playwright = None
        self.pages = []


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000
