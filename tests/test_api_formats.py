"""Every OpenAI response format through the official ``openai`` SDK, against a real server on the tiny model.

Each answer is decoded with PyAV (FFmpeg) and its length compared with the 16-bit PCM of the same
request (same seed): equal for the formats that carry their length (WAV, PCM, FLAC, Ogg Opus, a whole
MP3 with its LAME header), and within one codec frame once the encoder delay is counted where the
format cannot say it (ADTS AAC; a streamed MP3, whose LAME header cannot be rewritten).
"""

import base64
import io
import json
import os

import av
import httpx
import numpy as np
import pytest
from openai import BadRequestError, OpenAI
from test_server import LONG, SHORT, VOICE, make_service

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

from cosyapp.codec import MEDIA_TYPES  # noqa: E402

RATE = 24_000
MP3_DELAY = 576 + 529  # LAME's encoder delay and the MP3 decoder's
AAC_DELAY = 1024  # FFmpeg's AAC encoder priming
# format: (samples per codec frame at 24 kHz, encoder delay in a whole file, in a streamed one)
FRAMING = {
    "mp3": (576, 0, MP3_DELAY),
    "opus": (480, 0, 0),
    "aac": (1024, AAC_DELAY, AAC_DELAY),
    "flac": (1, 0, 0),
    "wav": (1, 0, 0),
    "pcm": (1, 0, 0),
}
COMPRESSED = ["mp3", "opus", "aac", "flac"]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return make_service(tmp_path_factory)


@pytest.fixture(scope="module")
def sdk(url):
    with OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0, timeout=120) as client:
        yield client


def decoded_samples(data: bytes, response_format: str, partial: bool = False) -> int:
    """Samples at 24 kHz that FFmpeg decodes from ``data``; ``partial``: a file's first bytes only."""
    if response_format == "pcm":
        return len(data) // 2
    count = 0
    try:
        with av.open(io.BytesIO(data)) as container:
            for frame in container.decode(audio=0):
                assert frame.layout.nb_channels == 1
                count += frame.samples * RATE // frame.sample_rate  # Opus decodes at 48 kHz
    except (av.error.InvalidDataError, av.error.EOFError):
        if not partial:
            raise
    return count


def pcm_length(sdk, text: str, streamed: bool) -> int:
    """Samples of the 16-bit PCM answer for ``text`` with seed 3, whole or streamed."""
    extra = {"stream_format": "audio"} if streamed else {}
    speech = sdk.audio.speech.create(
        model="tts-1", voice=VOICE, input=text, response_format="pcm", extra_body={"seed": 3}, **extra
    )
    return len(speech.content) // 2


@pytest.fixture(scope="module")
def whole_length(sdk) -> int:
    return pcm_length(sdk, SHORT, streamed=False)


@pytest.fixture(scope="module")
def streamed_length(sdk) -> int:
    return pcm_length(sdk, LONG, streamed=True)


def assert_length(decoded: int, expected: int, response_format: str, streamed: bool) -> None:
    frame, whole_delay, stream_delay = FRAMING[response_format]
    delay = stream_delay if streamed else whole_delay
    assert expected > 0 and 0 <= decoded - delay - expected < frame, (decoded, delay, expected)


def test_a_request_naming_no_format_gets_mp3_as_from_openai(sdk, whole_length):
    speech = sdk.audio.speech.create(model="tts-1", voice=VOICE, input=SHORT, extra_body={"seed": 3})
    assert speech.response.headers["content-type"] == "audio/mpeg"
    assert_length(decoded_samples(speech.content, "mp3"), whole_length, "mp3", False)


@pytest.mark.parametrize("response_format", list(FRAMING))
def test_every_format_decodes_to_the_clip_length_with_its_content_type(sdk, whole_length, response_format):
    speech = sdk.audio.speech.create(
        model="tts-1", voice=VOICE, input=SHORT, response_format=response_format, extra_body={"seed": 3}
    )
    assert speech.response.headers["content-type"] == MEDIA_TYPES[response_format]
    assert_length(decoded_samples(speech.content, response_format), whole_length, response_format, False)


@pytest.mark.parametrize("response_format", COMPRESSED)
def test_streamed_formats_decode_from_their_first_bytes_while_the_clip_is_made(
    sdk, service, streamed_length, response_format
):
    with sdk.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice=VOICE,
        input=LONG,
        response_format=response_format,
        stream_format="audio",
        extra_body={"seed": 3},
    ) as response:
        assert response.headers["content-type"] == MEDIA_TYPES[response_format]
        pieces = response.iter_bytes()
        received = b""
        while decoded_samples(received, response_format, partial=True) == 0:
            received += next(pieces)
        running_at_first_audio = service.pipeline.health()["active_streams"]
        received += b"".join(pieces)
    assert running_at_first_audio == 1  # the first audio decoded before the request ended
    assert_length(decoded_samples(received, response_format), streamed_length, response_format, True)


# Nine sentences: the paced demo model makes a sentence of a chunk or two, and SSE should show several.
SSE_TEXT = " ".join([LONG] * 3)


def sse_events(url: str, **body) -> tuple[str, list[dict]]:
    request = {"model": "tts-1", "voice": VOICE, "input": SSE_TEXT, "seed": 3, "stream_format": "sse", **body}
    response = httpx.post(f"{url}/v1/audio/speech", json=request, timeout=120)
    assert response.status_code == 200, response.text
    blocks = [block for block in response.text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks)
    return response.headers["content-type"], [json.loads(block.removeprefix("data: ")) for block in blocks]


def test_sse_events_carry_base64_audio_adding_up_to_the_streamed_clip(url, sdk):
    content_type, events = sse_events(url, response_format="pcm")
    assert content_type.startswith("text/event-stream")
    assert [e["type"] for e in events] == ["speech.audio.delta"] * (len(events) - 1) + ["speech.audio.done"]
    assert len(events) > 3  # several deltas: sent as the audio was made
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    streamed = sdk.audio.speech.create(
        model="tts-1",
        voice=VOICE,
        input=SSE_TEXT,
        response_format="pcm",
        stream_format="audio",
        extra_body={"seed": 3},
    ).content
    assert len(audio) == len(streamed)
    difference = np.frombuffer(audio, "<i2").astype(int) - np.frombuffer(streamed, "<i2")
    assert np.abs(difference).max() <= 1  # float rounding of the batches it shared, at most one step


def test_sse_deltas_of_a_compressed_format_form_one_file(url, streamed_length):
    _, events = sse_events(url, response_format="opus", input=LONG)
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert audio.startswith(b"OggS")
    assert_length(decoded_samples(audio, "opus"), streamed_length, "opus", True)


def test_instructions_select_instruct2_and_a_bad_one_is_a_clear_400(sdk):
    audio = sdk.audio.speech.create(
        model="gpt-4o-mini-tts",
        voice=VOICE,
        input=SHORT,
        instructions="用四川话说这句话",
        response_format="pcm",
    )
    assert len(audio.content) > 0 and len(audio.content) % 2 == 0
    with pytest.raises(BadRequestError) as refused:
        sdk.audio.speech.create(model="gpt-4o-mini-tts", voice=VOICE, input=SHORT, instructions="x" * 201)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == "instructions"
    assert error["message"] == "The instruction is 201 characters long; the limit is 200."


def test_the_mode_extension_selects_cross_lingual_and_refuses_others(url):
    body = {"input": SHORT, "voice": VOICE, "response_format": "pcm", "seed": 1}
    spoken = httpx.post(f"{url}/v1/audio/speech", json={**body, "mode": "cross_lingual"})
    assert spoken.status_code == 200 and len(spoken.content) > 0
    for extra, param, message in [
        ({"mode": "vc"}, "mode", "Unknown mode 'vc'; use one of: zero_shot, cross_lingual, instruct2."),
        (
            {"mode": "cross_lingual", "instructions": "Speak softly."},
            "instructions",
            "Instructions apply to the instruct2 mode only, not to cross_lingual.",
        ),
    ]:
        refused = httpx.post(f"{url}/v1/audio/speech", json={**body, **extra})
        error = refused.json()["error"]
        assert refused.status_code == 400 and (error["param"], error["message"]) == (param, message)


def test_unknown_formats_are_refused_naming_the_supported_ones(url):
    for field, value, supported in [
        ("response_format", "ogg", "mp3, opus, aac, flac, wav, pcm"),
        ("stream_format", "chunks", "audio, sse"),
    ]:
        response = httpx.post(f"{url}/v1/audio/speech", json={"input": SHORT, "voice": VOICE, field: value})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == field
        assert error["message"] == f"Unsupported {field} {value!r}; use one of: {supported}."
