"""Voice previews on a real server over the tiny model: made once per voice and model through the
Pipeline (concurrent requests share one synthesis), served from disk afterwards with an ETag,
private voices reachable only through the URL their page was given, deleted with their voice, made
again for a changed model, and bounded on disk."""

import asyncio
import os
import shutil
import wave
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO

import httpx
import pytest
from test_server import make_service, serving, wait_until

from cosyapp.frontend.voices import ASSETS_VOICES, VoiceInfo
from cosyapp.previews import SENTENCES, preview_text
from cosyapp.web.server import build_app

AISHELL = ASSETS_VOICES / "zh-aishell-w0121.wav"
AISHELL_TEXT = "甚至出现交易几乎停滞的情况"
OWNER = "0123456789abcdef0123456789abcdef"


def own_service(tmp_path_factory, name: str, **overrides):
    """A service with a data folder of its own, so its previews start from none."""
    return make_service(tmp_path_factory, data_dir=tmp_path_factory.mktemp(name) / "data", **overrides)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return own_service(tmp_path_factory, "previews")


@pytest.fixture(scope="module")
def http(service):
    with serving(build_app(service)) as base, httpx.Client(base_url=base, timeout=120) as client:
        yield client


async def previews_of(service, *voice_ids: str) -> None:
    """Ask for each voice's preview in turn, in process, then stop the engines."""
    try:
        for voice_id in voice_ids:
            await service.previews.audio(voice_id, None)
            await asyncio.sleep(0.02)  # distinct modification times: the order of plays
    finally:
        await service.pipeline.shutdown()


def seconds(data: bytes) -> float:
    with wave.open(BytesIO(data)) as reader:
        assert (reader.getnchannels(), reader.getsampwidth(), reader.getframerate()) == (1, 2, 24_000)
        return reader.getnframes() / reader.getframerate()


def test_the_sentence_is_in_the_voices_language():
    def info(language: str) -> VoiceInfo:
        return VoiceInfo(id="v", name="v", kind="user", language=language)

    assert preview_text(info("zh")) == SENTENCES["zh"]
    assert preview_text(info("ja")) == SENTENCES["ja"]
    assert preview_text(info("fr")) == SENTENCES["en"]
    assert preview_text(info(""), transcript=AISHELL_TEXT) == SENTENCES["zh"]
    assert preview_text(info(""), transcript="Hello there") == SENTENCES["en"]
    assert preview_text(info(""), transcript="안녕하세요 여러분") == SENTENCES["ko"]
    assert preview_text(info(""), transcript="") == SENTENCES["en"]


def test_concurrent_requests_for_a_new_preview_share_one_synthesis(http, service):
    started = service.pipeline.metrics.snapshot()["requests"]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: http.get("/v1/audio/voices/en-espeak-gb/preview"), range(3)))
    assert [a.status_code for a in answers] == [200] * 3
    assert answers[0].content == answers[1].content == answers[2].content
    assert 1.0 < seconds(answers[0].content) < 10.0
    assert service.pipeline.metrics.snapshot()["requests"] == started + 1
    assert service.previews.path("en-espeak-gb").read_bytes() == answers[0].content


def test_a_made_preview_is_served_from_disk_and_revalidated_by_its_etag(http, service):
    first = http.get("/v1/audio/voices/zh-aishell-w0122/preview")
    assert first.status_code == 200 and first.headers["content-type"] == "audio/wav"
    assert first.headers["cache-control"] == "no-cache"
    started = service.pipeline.metrics.snapshot()["requests"]
    again = http.get("/v1/audio/voices/zh-aishell-w0122/preview")
    assert again.content == first.content and again.headers["etag"] == first.headers["etag"]
    unchanged = http.get(
        "/v1/audio/voices/zh-aishell-w0122/preview", headers={"If-None-Match": first.headers["etag"]}
    )
    assert unchanged.status_code == 304 and unchanged.content == b""
    assert service.pipeline.metrics.snapshot()["requests"] == started


def test_the_same_voice_and_model_give_the_same_preview(http, service):
    first = http.get("/v1/audio/voices/en-espeak-us/preview").content
    service.previews.path("en-espeak-us").unlink()
    assert http.get("/v1/audio/voices/en-espeak-us/preview").content == first  # fixed text and seed


def test_a_private_voice_is_previewed_only_through_its_pages_signed_url(http, service):
    info = service.voices.save("Private preview voice", AISHELL, AISHELL_TEXT, OWNER)
    api = http.get(f"/v1/audio/voices/{info.id}/preview")
    assert api.status_code == 404
    assert api.json()["error"]["message"] == f"Voice {info.id!r} not found; pick one of the listed voices."
    url = service.previews.url(info.id)
    page = http.get(url)
    assert page.status_code == 200 and seconds(page.content) > 1.0
    assert page.headers["cache-control"] == "private, max-age=86400"
    other = service.previews.url("en-espeak-us")
    forged = url.replace(url.rsplit("sig=", 1)[1], other.rsplit("sig=", 1)[1])
    assert http.get(forged).status_code == 404
    assert http.get(url.replace(service.previews.fingerprint, "0" * 16)).status_code == 404


def save_voice(http, name: str) -> dict:
    """A shared voice saved through the API from the AISHELL recording."""
    files = {"file": ("aishell.wav", AISHELL.read_bytes())}
    return http.post("/v1/audio/voices", data={"name": name, "transcript": AISHELL_TEXT}, files=files).json()


def test_deleting_a_voice_deletes_its_previews(http, service):
    made = save_voice(http, "Shared preview voice")
    assert http.get(f"/v1/audio/voices/{made['id']}/preview").status_code == 200
    path = service.previews.path(made["id"])
    assert path.is_file() and path.parent.name == made["id"]
    assert http.delete(f"/v1/audio/voices/{made['id']}").status_code == 200
    assert not path.exists()
    assert http.get(f"/v1/audio/voices/{made['id']}/preview").status_code == 404


def test_a_voice_saved_through_the_api_gets_its_preview_in_the_background(http, service):
    made = save_voice(http, "Background preview voice")
    wait_until(lambda: service.previews.ready(made["id"]), timeout=120)
    started = service.pipeline.metrics.snapshot()["requests"]
    assert http.get(f"/v1/audio/voices/{made['id']}/preview").status_code == 200
    assert service.pipeline.metrics.snapshot()["requests"] == started


def test_a_changed_model_gets_new_previews_at_start(tmp_path_factory, service):
    model = tmp_path_factory.mktemp("changed") / "model"
    shutil.copytree(service.model_dir, model)
    data = tmp_path_factory.mktemp("changed-data") / "data"
    first = make_service(tmp_path_factory, demo=False, model=str(model), data_dir=data)
    asyncio.run(previews_of(first, "en-espeak-us"))
    old = first.previews.path("en-espeak-us")
    llm = model / "llm.pt"
    os.utime(llm, ns=(llm.stat().st_atime_ns, llm.stat().st_mtime_ns + 10**9))  # the weights changed
    second = make_service(tmp_path_factory, demo=False, model=str(model), data_dir=data)
    assert second.previews.fingerprint != first.previews.fingerprint
    with serving(build_app(second)):
        wait_until(lambda: second.previews.ready("en-espeak-us"), timeout=120)
        # The new file is published first, then the other model's is removed (the store never
        # lacks one), so the removal may come a moment after ready().
        wait_until(lambda: not old.exists(), timeout=10)
        assert not second.previews.ready("en-espeak-gb")  # it had none: made when first listed or asked


def test_the_store_keeps_the_most_recently_played_previews(tmp_path_factory):
    bounded = own_service(tmp_path_factory, "bounded")
    bounded.previews.max_stored = 2
    asyncio.run(previews_of(bounded, "en-espeak-us", "en-espeak-gb", "en-espeak-us", "zh-aishell-w0121"))
    ready = {v: bounded.previews.ready(v) for v in ("en-espeak-us", "en-espeak-gb", "zh-aishell-w0121")}
    assert ready == {"en-espeak-us": True, "en-espeak-gb": False, "zh-aishell-w0121": True}
