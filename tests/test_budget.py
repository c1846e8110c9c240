"""A budget per request: a sentence stops at its limit and the request goes on, a request stops at
its own, and either way the audio made so far comes with a note (engine/budget.py).

On the endless tiny model, which never stops on its own, every sentence reaches its limit; through
the API on the demo model a request forced past its budget says so in SSE's done event and in a
whole response's header.
"""

import asyncio
import base64
import json

import httpx
import pytest
from test_pipeline import parts  # noqa: F401  (the endless tiny model, its text frontend, a voice)
from test_server import VOICE, make_service, serving

from cosyapp.engine.budget import TOKENS_PER_S, AudioBudget
from cosyapp.engine.lm.torch_engine import TorchSpeechLM
from cosyapp.engine.pipeline import Pipeline, SynthesisRequest
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.web.server import build_app

SAMPLES_PER_TOKEN = 960  # 24 kHz / 25 tokens per second
TWO = "One two three four five six seven eight nine ten eleven twelve. " * 3  # two sentences


def synthesize(parts, budget, text, streaming=True):  # noqa: F811
    model, frontend, voice = parts

    async def main():
        pipeline = Pipeline(model, frontend, TorchSpeechLM(model.lm), Token2Wav(model), budget=budget)
        try:
            request = SynthesisRequest(text, voice, seed=1, streaming=streaming)
            return [chunk async for chunk in pipeline.stream(request)]
        finally:
            await pipeline.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("streaming", [True, False])
def test_a_sentence_stops_at_its_limit_with_a_note_and_the_next_one_follows(parts, streaming):  # noqa: F811
    # At 100 syllables a second every sentence gets the 2 s floor: 50 tokens of its 20 x text tokens.
    chunks = synthesize(parts, AudioBudget(100.0, 1800.0), TWO, streaming)
    sentences = sorted({c.sentence for c in chunks})
    assert sentences == [0, 1] == list(range(len(parts[1].prepare(TWO))))
    for index in sentences:
        mine = [c for c in chunks if c.sentence == index]
        assert sum(len(c.samples) for c in mine) == 2 * TOKENS_PER_S * SAMPLES_PER_TOKEN
        assert mine[-1].note == f"Sentence {index + 1} was cut short at the server's limit of 2.0 s " + (
            "of audio for a sentence of its length."
        )
        assert len(mine[-1].samples) == 0 and all(c.note is None for c in mine[:-1])


def test_a_request_stops_at_its_limit_with_a_note_and_starts_no_other_sentence(parts):  # noqa: F811
    chunks = synthesize(parts, AudioBudget(0.0, 3.0), TWO)
    assert {c.sentence for c in chunks} == {0}
    assert sum(len(c.samples) for c in chunks) == 3 * TOKENS_PER_S * SAMPLES_PER_TOKEN
    assert chunks[-1].note.startswith("The audio stops early: this request reached the server's limit of 3 s")


def test_without_a_budget_sentences_reach_upstreams_maximum(parts):  # noqa: F811
    model, frontend, _ = parts
    # Whole clips: one flow call per sentence (a stream would recompute its prefix at every chunk
    # of these 24 s of audio, minutes on a CPU); the budget's cut is the same in both.
    chunks = synthesize(parts, AudioBudget(0.0, float("inf")), TWO, streaming=False)
    tokens = sum(20 * len(s.ids) for s in frontend.prepare(TWO))
    assert sum(len(c.samples) for c in chunks) == tokens * SAMPLES_PER_TOKEN
    assert all(c.note is None for c in chunks)


# --- the API, on the demo model --------------------------------------------------------------------

FORCED = "Hello there. How are you today? Fine thanks, and you? " * 3


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    service = make_service(tmp_path_factory, max_request_audio_s=1.0)
    with serving(build_app(service)) as base:
        yield base


def test_the_api_says_in_the_sse_done_event_that_the_budget_cut_the_speech(url):
    body = {"input": FORCED, "voice": VOICE, "stream_format": "sse", "response_format": "pcm", "seed": 1}
    response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=120)
    events = [json.loads(b[len("data: ") :]) for b in response.text.split("\n\n") if b]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["note"].startswith(
        "The audio stops early: this request reached the server's limit of 1 s"
    )
    assert 0 < len(audio) <= 2 * 24_000  # 16-bit samples of at most 1 s


def test_the_api_sets_the_note_header_on_a_whole_response_the_budget_cut(url):
    body = {"input": FORCED, "voice": VOICE, "response_format": "pcm", "seed": 1}
    response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=120)
    assert response.status_code == 200
    assert response.headers["x-audio-note"].startswith("The audio stops early")
    assert 0 < len(response.content) <= 2 * 24_000
