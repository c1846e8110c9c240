"""POST /v1/audio/speech: OpenAI's speech request, answered as a whole file, a byte stream or events.

- whole (default): the clip synthesised, then encoded as one file of ``response_format``; errors
  before the first byte are JSON with their status;
- ``"stream": true``: the file's bytes as the audio is made (``codec.AudioEncoder``);
- ``"stream_format": "sse"``: OpenAI's server-sent events, ``speech.audio.delta`` with base64 bytes
  of the same stream, then ``speech.audio.done``; ``"stream_format": "audio"`` streams as
  ``"stream": true`` does (OpenAI streams whenever a stream format is named).

No work outlives its client: a streamed response closes the pipeline stream when the client goes
(``AudioBody``); a whole-clip request watches for the disconnect while it synthesises and stops.
"""

import asyncio
import base64
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from cosyapp.codec import FORMATS, MEDIA_TYPES, AudioEncoder, encode_clip
from cosyapp.engine.pipeline import AudioChunk, Pipeline
from cosyapp.engine.request import SynthesisRequest, check_request
from cosyapp.errors import ParamError
from cosyapp.frontend.modes import CROSS_LINGUAL, INSTRUCT, ZERO_SHOT, check_mode
from cosyapp.service import Service
from cosyapp.web.clients import client_key
from cosyapp.web.request_ids import request_id_of

log = logging.getLogger(__name__)

STREAM_FORMATS = ("audio", "sse")
SSE_MEDIA_TYPE = "text/event-stream"
# The modes this route speaks in: OpenAI's `instructions` select instruct2, `mode` the others.
SPEECH_MODES = (ZERO_SHOT, CROSS_LINGUAL, INSTRUCT)
# Set on a whole response whose speech the audio budget cut (engine/budget.py); a streamed one says
# it in the SSE done event's "note", and a plain byte stream cannot say it once its headers are sent.
NOTE_HEADER = "X-Audio-Note"
# Proxies (e.g. the one in front of a Space) must pass chunks on, not buffer the response.
STREAM_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}

T = TypeVar("T")


class SpeechRequest(BaseModel):
    """Body of POST /v1/audio/speech: OpenAI's fields plus ``stream`` and ``seed``. Strict types, no
    unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = "cosyvoice2"  # accepted for OpenAI clients; the one loaded model serves every request
    input: str
    voice: str
    instructions: str | None = None
    mode: str | None = None  # not OpenAI's: "cross_lingual" (or "zero_shot", the default)
    speed: float = 1.0
    response_format: str = "mp3"  # OpenAI's default: a client that names no format expects MP3
    stream_format: str = "audio"
    stream: bool = False
    seed: int | None = None

    def check(self, max_chars: int) -> None:
        """Raise the ``UserError`` of the first field that cannot be served (the request rules,
        then the format fields, then the mode and instructions)."""
        check_request(self.input, self.speed, self.seed, max_chars)
        for name, value, allowed in [
            ("response_format", self.response_format, FORMATS),
            ("stream_format", self.stream_format, STREAM_FORMATS),
        ]:
            if value not in allowed:
                raise ParamError(f"Unsupported {name} {value!r}; use one of: {', '.join(allowed)}.", name)
        if self.synthesis_mode not in SPEECH_MODES:
            raise ParamError(f"Unknown mode {self.mode!r}; use one of: {', '.join(SPEECH_MODES)}.", "mode")
        check_mode(self.synthesis_mode, self.instructions)

    @property
    def synthesis_mode(self) -> str:
        """``mode`` if given, else instruct2 when there are instructions (an empty string asks for
        nothing), else zero-shot."""
        return self.mode or (INSTRUCT if self.instructions else ZERO_SHOT)


class ClientGone(Exception):
    """The client of a request disconnected before its answer was ready."""


def speech_route(service: Service):
    pipeline = service.pipeline

    async def speech(body: SpeechRequest, http: Request) -> Response:
        """Speak ``input`` in ``voice`` as ``response_format`` (24 kHz mono), whole or streamed."""
        body.check(service.settings.max_text_chars)
        voice = await asyncio.to_thread(service.voices.get, body.voice)
        # OpenAI streams whenever a stream_format is named; a plain request gets the whole file.
        streaming = body.stream or "stream_format" in body.model_fields_set
        client = client_key(None, http.client.host if http.client else None)
        request = SynthesisRequest(
            body.input,
            voice,
            body.speed,
            body.seed,
            streaming,
            client,
            request_id_of(http),
            mode=body.synthesis_mode,
            instruction=body.instructions or None,
        )
        return await audio_response(http, pipeline, request, body.response_format, body.stream_format)

    return speech


async def audio_response(
    http: Request, pipeline: Pipeline, request: SynthesisRequest, response_format: str, stream_format: str
) -> Response:
    """The answer to ``request`` (already checked) as ``response_format``: the whole file, or when
    ``request.streaming`` its bytes (``stream_format`` "audio") or OpenAI's events ("sse") as made."""
    chunks = pipeline.stream(request)
    try:
        if not request.streaming:
            samples, notes = await until_disconnected(http, _whole(chunks))
            data = await asyncio.to_thread(encode_clip, samples, response_format, pipeline.sample_rate)
            headers = {NOTE_HEADER: " ".join(notes)} if notes else None
            return Response(data, media_type=MEDIA_TYPES[response_format], headers=headers)
        # A full server raises before the first chunk, while a status can still be sent.
        first = await until_disconnected(http, anext(chunks, None))
    except ClientGone:
        await chunks.aclose()
        log.info("request %s: the client left; its synthesis stopped", request.request_id)
        return Response(status_code=499)  # never sent: nobody is listening
    encoder = AudioEncoder(response_format, pipeline.sample_rate)
    audio = AudioBody(chunks, first, encoder)
    if stream_format == "sse":
        return ClosingStream(audio, sse_events(audio), SSE_MEDIA_TYPE)
    return ClosingStream(audio, audio, MEDIA_TYPES[response_format])


async def _whole(chunks: AsyncGenerator[AudioChunk, None]) -> tuple[np.ndarray, list[str]]:
    try:
        got = [chunk async for chunk in chunks]
    finally:
        await chunks.aclose()
    pieces = [chunk.samples for chunk in got]
    notes = [chunk.note for chunk in got if chunk.note]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32), notes


async def until_disconnected(http: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ``ClientGone`` once the client of ``http`` disconnects first (``work``
    is then cancelled and awaited). Call after the body is read: the next ASGI message is the
    disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


class AudioBody:
    """The encoded bytes of a pipeline stream, as produced; ``aclose`` ends the stream (aborts its
    LM request, drops its token2wav work). Compressed formats encode in a thread, off the loop."""

    def __init__(
        self, chunks: AsyncGenerator[AudioChunk, None], first: AudioChunk | None, encoder: AudioEncoder
    ):
        self.chunks = chunks
        self.first = first
        self.encoder = encoder
        self.notes: list[str] = []  # the budget's notes (``AudioChunk.note``), as they come

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.first is not None:
            self._note(self.first)
            yield await self._encode(self.encoder.push, self.first.samples)
        async for chunk in self.chunks:
            self._note(chunk)
            data = await self._encode(self.encoder.push, chunk.samples)
            if data:
                yield data
        yield await self._encode(self.encoder.finish)

    async def _encode(self, step: Callable[..., bytes], *args: np.ndarray) -> bytes:
        if self.encoder.format in ("wav", "pcm"):  # a numpy conversion: microseconds a chunk
            return step(*args)
        return await asyncio.to_thread(step, *args)

    def _note(self, chunk: AudioChunk) -> None:
        if chunk.note:
            self.notes.append(chunk.note)

    async def aclose(self) -> None:
        await self.chunks.aclose()


async def sse_events(audio: AudioBody) -> AsyncIterator[bytes]:
    """OpenAI's speech events: a ``speech.audio.delta`` per piece of ``audio``, then ``speech.audio.done``
    (with ``note`` when the audio budget cut the speech)."""
    async for data in audio:
        if data:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    yield _event({"type": "speech.audio.done"} | ({"note": " ".join(audio.notes)} if audio.notes else {}))


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class ClosingStream(StreamingResponse):
    """A streamed response that closes ``audio`` after the response however it ended, so a client
    that goes away aborts its engine work and frees its stream slot at once."""

    def __init__(self, audio: AudioBody, content: AsyncIterator[bytes], media_type: str):
        self.audio = audio
        super().__init__(content, media_type=media_type, headers=STREAM_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # the request's scope is cancelled on a disconnect
                await self.audio.aclose()
