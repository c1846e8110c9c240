"""A 5,000-character text starts as promptly as a short one, through the API on the demo model:
its text is prepared a block at a time (engine/text_workers.py), so headers and first audio come
within seconds, another stream's chunks keep coming meanwhile, and closing the connection frees
its stream slot at once. Bounds are generous: the CI machine is slow and shared.
"""

import threading
import time

import httpx
import pytest
from test_server import VOICE, make_service, serving

from cosyapp.web.server import build_app

EN_UNIT = (
    "On 3/14/2025 at 10:45 a.m., Dr. Smith of St. Mary's paid $1,234.56 for invoice no. 42, "
    "i.e. 15% more than in 1999. Mr. Jones agreed. "
)
ZH_UNIT = "2024年3月5日上午10点45分，张医生花了1234.56元买了42本书，比1999年多了15%。大家都同意。"
TEXTS = {"en": (EN_UNIT * 60)[:5000], "zh": (ZH_UNIT * 120)[:5000]}
OTHER = "Hello there. How are you today? Fine thanks, and you? I am well. " * 3
FIRST_AUDIO_S = 30.0  # about 1-2 s on an idle 2-core machine
MAX_GAP_S = 15.0


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    service = make_service(tmp_path_factory)
    with serving(build_app(service)) as base:
        yield base


def speech(url, text, seed):
    body = {"input": text, "voice": VOICE, "stream": True, "response_format": "pcm", "seed": seed}
    return httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=120)


def active_streams(url) -> int:
    return httpx.get(f"{url}/health", timeout=30).json()["active_streams"]


class Other(threading.Thread):
    """Streams OTHER and records when each piece of audio arrives."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url, self.arrivals = url, []

    def run(self):
        with speech(self.url, OTHER, seed=7) as response:
            for _ in response.iter_raw():
                self.arrivals.append(time.perf_counter())


@pytest.mark.parametrize("language", ["en", "zh"])
def test_a_5000_character_text_starts_promptly_beside_another_stream_and_cancels_at_once(url, language):
    text = TEXTS[language]
    assert len(text) == 5000
    other = Other(url)
    other.start()
    while not other.arrivals and other.is_alive():
        time.sleep(0.05)
    sent = time.perf_counter()
    with speech(url, text, seed=1) as response:
        headers = time.perf_counter() - sent
        assert response.status_code == 200
        pieces = response.iter_raw()
        first = next(pieces)
        first_audio = time.perf_counter() - sent
        assert first
        deadline = time.perf_counter() + 3.0
        for _ in pieces:  # keep it playing a little while the other stream goes on
            if time.perf_counter() > deadline:
                break
        closed = time.perf_counter()
    while active_streams(url) > (1 if other.is_alive() else 0) and time.perf_counter() - closed < 10:
        time.sleep(0.05)
    freed = time.perf_counter() - closed
    other.join(timeout=300)
    window = [t for t in other.arrivals if sent <= t <= closed]
    gaps = [b - a for a, b in zip(other.arrivals, other.arrivals[1:], strict=False) if sent <= b <= closed]
    print(
        f"{language}: headers {headers:.2f} s, first audio {first_audio:.2f} s, freed {freed:.2f} s, "
        f"other stream: {len(window)} pieces, largest gap {max(gaps, default=0):.2f} s"
    )
    assert headers < FIRST_AUDIO_S and first_audio < FIRST_AUDIO_S
    assert freed < 5.0
    assert not other.is_alive() and other.arrivals
    assert max(gaps, default=0.0) < MAX_GAP_S
