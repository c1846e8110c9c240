"""The voice gallery in headless Chromium, on the whole app (API routes, lifespan, the previews'
background task) over the tiny model: the cards of a page's voices, a preview played from disk
without a synthesis, "Use this voice", a saved voice's preview, delete for its owner only, paging and
filters over many shared voices, and the layout at phone width."""

import re
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import httpx
import pytest
from test_server import wait_until
from test_ui_browser import open_app, save_voice

from cosyapp.asr.whisper import Transcript
from cosyapp.frontend.voices import ASSETS_VOICES
from cosyapp.service import build_service
from cosyapp.settings import Settings
from cosyapp.web.server import build_app, serve_in_thread
from cosyapp.web.ui.events import Handlers
from cosyapp.web.ui.gallery import Gallery

SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
CARDS = "#gallery .cg-card"


def start(tmp_path_factory, name: str):
    """A service over the tiny model with a data folder of its own (so previews start from none)."""
    root = tmp_path_factory.getbasetemp()
    settings = Settings(
        demo=True,
        engine="torch",
        device="cpu",
        max_streams=4,
        cache_dir=root / "cache",
        data_dir=tmp_path_factory.mktemp(name) / "data",
    )
    return build_service(settings)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    service = start(tmp_path_factory, "gallery")
    with serve_in_thread(build_app(service)) as base:
        yield SimpleNamespace(service=service, url=base + "/")


def open_gallery(page, site) -> None:
    open_app(page, site)
    page.locator(CARDS).first.wait_for(timeout=15_000)


def card(page, name: str):
    return page.locator(CARDS).filter(
        has=page.locator(".cg-name", has_text=re.compile(f"^{re.escape(name)}$"))
    )


def card_names(page) -> list[str]:
    return page.locator(f"{CARDS} .cg-name").all_inner_texts()


def requests_started(site) -> int:
    metrics = httpx.get(site.url + "metrics", timeout=30).text
    return int(re.search(r"^cosyapp_requests_started_total (\d+)", metrics, re.M).group(1))


def wait_for_previews(site, voice_ids, timeout=120.0) -> None:
    wait_until(lambda: all(site.service.previews.ready(v) for v in voice_ids), timeout=timeout)


def test_the_gallery_lists_the_voices_of_the_page_with_their_facts(page, site):
    open_gallery(page, site)
    voices = site.service.voices.list_voices(None)
    assert card_names(page) == [v.name for v in voices]
    assert page.locator("#gallery .cg-count").inner_text() == f"{len(voices)} voices"
    aishell = card(page, voices[2].name)
    assert aishell.locator(".cg-badge").inner_text() == "Built-in"
    meta = aishell.locator(".cg-meta").inner_text()
    assert meta.startswith(f"{voices[2].language} · ") and re.search(r"\d+\.\d s prompt$", meta)
    assert voices[2].licence and voices[2].licence in aishell.locator(".cg-note").inner_text()


def test_a_preview_plays_from_disk_without_a_new_synthesis(page, site):
    open_gallery(page, site)  # opening the gallery queued the previews not made yet
    ids = [v.id for v in site.service.voices.list_voices(None)]
    wait_for_previews(site, ids)
    open_gallery(page, site)
    first = page.locator(CARDS).first
    assert first.get_attribute("data-ready") == "true"
    before, made = requests_started(site), site.service.previews.made
    first.locator(".cg-play").click()
    page.wait_for_function("(id) => window.cosyGallery.played.includes(id)", arg=ids[0], timeout=30_000)
    assert requests_started(site) == before and site.service.previews.made == made
    assert page.evaluate("() => window.cosyGallery.audio.duration") > 1.0


def test_use_this_voice_selects_it_in_the_form(page, site):
    open_gallery(page, site)
    voice = site.service.voices.list_voices(None)[3]
    card(page, voice.name).locator(".cg-use").click()
    page.wait_for_function(
        "(name) => document.querySelector('#voice input').value === name", arg=voice.name, timeout=10_000
    )
    assert card(page, voice.name).get_attribute("data-selected") == "true"


def test_a_voice_saved_in_the_page_gets_its_preview_in_the_background(page, site, recording):
    open_gallery(page, site)
    made = site.service.previews.made
    save_voice(page, recording, "Gallery saved voice")
    saved = card(page, "Gallery saved voice")
    saved.wait_for(timeout=10_000)
    assert saved.locator(".cg-badge").inner_text() == "Yours"
    voice_id = saved.get_attribute("data-voice")
    wait_for_previews(site, [voice_id])
    path = site.service.previews.path(voice_id)
    assert path.parent == site.service.voices.user_dir / voice_id and path.read_bytes()[:4] == b"RIFF"
    assert site.service.previews.made == made + 1


def test_delete_in_the_gallery_removes_a_voice_for_its_owner_only(browser, site, recording):
    owner, other = browser.new_page(), browser.new_page()
    try:
        open_gallery(owner, site)
        save_voice(owner, recording, "Gallery team voice", shared=True)
        mine = card(owner, "Gallery team voice")
        mine.wait_for(timeout=10_000)
        voice_id = mine.get_attribute("data-voice")
        wait_for_previews(site, [voice_id])
        open_gallery(other, site)
        theirs = card(other, "Gallery team voice")
        assert theirs.locator(".cg-badge").inner_text() == "Shared"
        assert theirs.locator(".cg-delete").count() == 0 and theirs.locator(".cg-rename").count() == 0

        mine.locator(".cg-delete").click()
        assert mine.locator(".cg-delete").inner_text() == "Really delete?"
        mine.locator(".cg-delete").click()
        owner.get_by_text("Deleted “Gallery team voice”.").first.wait_for(timeout=10_000)
        mine.wait_for(state="detached", timeout=10_000)
        assert not (site.service.voices.user_dir / voice_id).exists()  # its previews went with it
        gone = httpx.get(f"{site.url}v1/audio/voices/{voice_id}/preview", timeout=30)
        assert gone.status_code == 404
        other.locator("#gallery .cg-refresh").click()
        theirs.wait_for(state="detached", timeout=10_000)
    finally:
        owner.close()
        other.close()


def test_a_private_voice_is_renamed_and_shared_from_its_card_and_hidden_from_others(browser, site, recording):
    owner, other = browser.new_page(), browser.new_page()
    try:
        open_gallery(owner, site)
        save_voice(owner, recording, "Gallery private voice")
        mine = card(owner, "Gallery private voice")
        voice_id = mine.get_attribute("data-voice")
        open_gallery(other, site)
        assert "Gallery private voice" not in card_names(other)

        mine.locator(".cg-rename").click()
        mine.locator(".cg-new-name").fill("Gallery renamed voice")
        mine.locator(".cg-save-name").click()
        renamed = card(owner, "Gallery renamed voice")
        renamed.wait_for(timeout=10_000)
        assert site.service.voices.info(voice_id, site.service.voices.owner_of(voice_id)).name == (
            "Gallery renamed voice"
        )
        renamed.locator(".cg-share").click()
        owner.get_by_text("“Gallery renamed voice” is shared with everyone.").first.wait_for(timeout=10_000)
        other.locator("#gallery .cg-refresh").click()
        card(other, "Gallery renamed voice").wait_for(timeout=10_000)
    finally:
        owner.close()
        other.close()


def test_the_card_actions_refuse_a_voice_of_another_browser_or_of_the_server(site, recording):
    gallery = Gallery(site.service, Handlers(site.service))
    info = site.service.voices.save("Someone else's voice", recording[0], recording[1], "a" * 32, shared=True)

    def event(**data) -> gr.EventData:
        return gr.EventData(None, {"voice": info.id} | data)

    with pytest.raises(gr.Error, match="saved in another browser; only that browser can rename it"):
        gallery.rename("b" * 32, event(name="Taken over"))
    with pytest.raises(gr.Error, match="only that browser can share it"):
        gallery.share("b" * 32, event(shared=False))
    with pytest.raises(gr.Error, match="only that browser can delete it"):
        gallery.delete("b" * 32, event())
    with pytest.raises(
        gr.Error, match="Pick one of your saved voices to share; the others come with the server"
    ):
        gallery.share("b" * 32, gr.EventData(None, {"voice": "en-espeak-us", "shared": False}))
    with pytest.raises(gr.Error, match="must be true or false"):
        gallery.share("a" * 32, event(shared="yes"))
    assert site.service.voices.info(info.id) == info  # unchanged, still shared
    listing, _ = gallery.rename("a" * 32, event(name="Its owner renamed it"))
    assert {c["name"] for c in listing["voices"] if c["id"] == info.id} == {"Its owner renamed it"}


def test_a_voice_saved_as_the_recogniser_heard_it_keeps_the_language_it_was_heard_in(site, recording):
    handlers, (path, text) = Handlers(site.service), recording

    def saved_language(box: str, heard: Transcript) -> str:
        update, _ = handlers.save_voice("Heard voice", str(path), box, False, "c" * 32, heard)
        return site.service.voices.info(update["value"], "c" * 32).language

    assert saved_language(text, Transcript(text, "yue", demo=False)) == "yue"
    # Typed over, or heard by the demo model: the language its script is written for.
    assert saved_language(text + "了", Transcript(text, "yue", demo=False)) == "zh"
    assert saved_language(text, Transcript(text, "en", demo=True)) == "zh"


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    """A server with 150 more shared voices in its library; its previews' cap is none, so the
    background task makes none of them."""
    service = start(tmp_path_factory, "crowded")
    service.previews.max_stored = 0
    recording = ASSETS_VOICES / "zh-aishell-w0121.wav"
    for index in range(150):
        language = "zh" if index % 3 == 0 else "en"
        service.voices.save(
            f"Crowd voice {index:03d}", recording, "甚至出现交易几乎停滞的情况", None, True, language
        )
    with serve_in_thread(build_app(service)) as base:
        yield SimpleNamespace(service=service, url=base + "/")


def test_hundreds_of_voices_are_paged_searched_and_filtered_in_the_page(page, crowded):
    open_gallery(page, crowded)
    total = len(crowded.service.voices.list_voices(None))
    gallery = page.locator("#gallery")
    assert gallery.locator(".cg-count").inner_text() == f"{total} voices"
    assert page.locator(CARDS).count() == 12
    assert gallery.locator(".cg-page").inner_text() == f"Page 1 of {-(-total // 12)}"
    gallery.locator(".cg-next").click()
    assert gallery.locator(".cg-page").inner_text().startswith("Page 2 of")
    assert card_names(page)[0] != "English US (espeak-ng, synthetic)"

    gallery.locator(".cg-search").fill("crowd voice 14")
    assert card_names(page) == [f"Crowd voice {i}" for i in range(140, 150)]
    assert gallery.locator(".cg-count").inner_text() == f"10 of {total} voices"
    gallery.locator(".cg-search").fill("")
    gallery.locator(".cg-source").select_option("builtin")
    assert set(page.locator(f"{CARDS} .cg-badge").all_inner_texts()) == {"Built-in"}
    gallery.locator(".cg-source").select_option("shared")
    gallery.locator(".cg-language").select_option("zh")
    assert gallery.locator(".cg-count").inner_text() == f"50 of {total} voices"


def test_the_gallery_fits_a_phone(browser, site):
    page = browser.new_page(viewport={"width": 390, "height": 844}, device_scale_factor=2)
    try:
        open_gallery(page, site)
        page.locator("#gallery-box").scroll_into_view_if_needed()
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= 390, f"the page scrolls sideways: {width} px"
        boxes = [page.locator(CARDS).nth(i).bounding_box() for i in range(2)]
        assert boxes[1]["y"] > boxes[0]["y"] and abs(boxes[1]["x"] - boxes[0]["x"]) < 1  # one column
        play = page.locator(CARDS).first.locator(".cg-play").bounding_box()
        assert play["height"] >= 36  # a finger's target
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.locator("#gallery-box").screenshot(path=SCREENSHOTS / "gallery-phone.png")
    finally:
        page.close()
    desktop = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        open_gallery(desktop, site)
        desktop.locator("#gallery-box").screenshot(path=SCREENSHOTS / "gallery-desktop.png")
    finally:
        desktop.close()
