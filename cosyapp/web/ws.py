"""WebSocket ``/v1/audio/speech/stream``: text streamed in (an LLM's deltas), audio streamed out.

Client -> server, JSON text frames:
    {"type": "start", "voice": ID, "speed": 1.0, "seed": N, "response_format": "pcm"}   first, once
    {"type": "text", "text": DELTA}      any number, any sizes
    {"type": "flush"}                    speak the text so far even if its sentence is not finished
    {"type": "end"}                      flush, then finish: the server closes after the last audio
Server -> client:
    {"type": "ready", "request_id", "sample_rate", "response_format", "media_type"}
    {"type": "sentence.start", "index", "text"}, then binary frames of audio, then
    {"type": "sentence.end", "index", "samples"}, for each sentence in order;
    {"type": "done", "sentences", "samples"}, then close 1000.
The binary frames of a connection, concatenated, are one file of ``response_format``.

Each sentence is synthesised as soon as ``SentenceCutter`` sees it complete, as a Pipeline request
of its own (same admission, fairness, limits and metrics as the HTTP API); while one sentence's
audio is sent, the next one is already being made, so there is no first-audio wait between
sentences. A client that reads slowly holds up the sends, and with them the sentence after next;
text that arrives faster than it is spoken waits in a bounded queue, and past it the server stops
reading.
Errors: {"type": "error", "error": {OpenAI's error object}}, then a close code (``CLOSE_CODES``).
"""

import asyncio
import json
import logging

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, ValidationError

from cosyapp.codec import FORMATS, MEDIA_TYPES, AudioEncoder
from cosyapp.engine.pipeline import sentence_seed
from cosyapp.engine.request import SynthesisRequest, check_options
from cosyapp.errors import BusyError, ParamError, UserError
from cosyapp.frontend.modes import INSTRUCT, ZERO_SHOT, check_mode
from cosyapp.frontend.text import has_nothing_to_read
from cosyapp.service import Service
from cosyapp.web.api_errors import INTERNAL_ERROR
from cosyapp.web.api_guard import max_body_bytes
from cosyapp.web.clients import client_key
from cosyapp.web.request_ids import request_id_of
from cosyapp.web.text_stream import SentenceCutter

log = logging.getLogger(__name__)

NORMAL, UNSUPPORTED_DATA, INVALID_DATA, POLICY, TOO_BIG, SERVER_ERROR, TRY_LATER = (
    1000, 1003, 1007, 1008, 1009, 1011, 1013,
)  # fmt: skip
CLOSE_CODES = {
    UNSUPPORTED_DATA: "a binary frame from the client",
    INVALID_DATA: "a frame that is not a JSON object",
    POLICY: "a message out of protocol, or a request the server refuses (bad start, unknown voice, text)",
    TOO_BIG: "a text message longer than --max-text-chars",
    SERVER_ERROR: "a server fault",
    TRY_LATER: "the server is busy",
}
PENDING_SENTENCES = 16  # text that arrives faster than it is spoken waits here


class StartMessage(BaseModel):
    """The first message: how to speak. Strict types, no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: str
    voice: str
    model: str = "cosyvoice2"
    instructions: str | None = None
    speed: float = 1.0
    seed: int | None = None
    response_format: str = "pcm"


class Refused(Exception):
    """End the connection with ``code`` after an error event of ``kind`` saying ``message``."""

    def __init__(
        self, code: int, message: str, kind: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.code, self.message, self.kind, self.param = code, message, kind, param


def speech_stream_route(service: Service):
    async def speech_stream(websocket: WebSocket) -> None:
        """Text deltas in, each finished sentence's audio out as it is made (see the module doc)."""
        await websocket.accept()
        await SpeechSession(service, websocket).run()

    return speech_stream


class SpeechSession:
    """One WebSocket connection: a reader of client messages and a speaker of sentences, as tasks."""

    def __init__(self, service: Service, websocket: WebSocket):
        self.service = service
        self.websocket = websocket
        self.request_id = request_id_of(websocket)
        self.max_chars = service.settings.max_text_chars
        self.sentences: asyncio.Queue[str | None] = asyncio.Queue(PENDING_SENTENCES)

    async def run(self) -> None:
        try:
            start = await self._start()
            tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._speak(start))]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in tasks:
                    task.cancel()  # the speaker's pipeline stream closes: its work is aborted
                await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            await self.websocket.close(NORMAL)
        except WebSocketDisconnect:
            log.info("request %s: the WebSocket client left", self.request_id)
        except Refused as refused:
            await self._refuse(refused)
        except BusyError as busy:
            await self._refuse(Refused(TRY_LATER, busy.message, "server_busy", busy.param))
        except UserError as error:
            await self._refuse(Refused(POLICY, error.message, param=error.param))
        except Exception:
            log.exception("request %s: the WebSocket speech stream failed", self.request_id)
            await self._refuse(Refused(SERVER_ERROR, INTERNAL_ERROR, "server_error"))

    async def _start(self) -> StartMessage:
        message = await self._receive()
        if message.get("type") != "start":
            raise Refused(POLICY, 'The first message must be {"type": "start", "voice": ...}.')
        try:
            start = StartMessage.model_validate(message)
        except ValidationError as invalid:
            error = invalid.errors()[0]
            field = ".".join(str(part) for part in error["loc"])
            raise Refused(POLICY, f"{field}: {error['msg']}", param=field) from None
        check_options(start.speed, start.seed)
        if start.response_format not in FORMATS:
            supported = ", ".join(FORMATS)
            message = f"Unsupported response_format {start.response_format!r}; use one of: {supported}."
            raise ParamError(message, "response_format")
        if start.instructions:  # OpenAI's instructions select instruct2; empty asks for nothing
            check_mode(INSTRUCT, start.instructions)
        self.voice = await asyncio.to_thread(self.service.voices.get, start.voice)
        await self.websocket.send_json(
            {
                "type": "ready",
                "request_id": self.request_id,
                "sample_rate": self.service.pipeline.sample_rate,
                "response_format": start.response_format,
                "media_type": MEDIA_TYPES[start.response_format],
            }
        )
        return start

    async def _receive(self) -> dict:
        message = await self.websocket.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        if message.get("text") is None:
            raise Refused(
                UNSUPPORTED_DATA, "Send JSON text messages; binary frames are not part of the protocol."
            )
        if len(message["text"]) > max_body_bytes(self.max_chars):
            raise Refused(TOO_BIG, f"A message may carry at most {self.max_chars} characters of text.")
        try:
            data = json.loads(message["text"])
        except ValueError as bad:
            raise Refused(INVALID_DATA, f"The message is not valid JSON: {bad}.") from None
        if not isinstance(data, dict):
            raise Refused(INVALID_DATA, 'A message must be a JSON object with a "type".')
        return data

    async def _read(self) -> None:
        """Client messages after the start: text into sentences, flush, end."""
        cutter = SentenceCutter()
        while True:
            message = await self._receive()
            kind = message.get("type")
            if kind == "text" and isinstance(message.get("text"), str):
                if len(message["text"]) > self.max_chars:
                    raise Refused(
                        TOO_BIG, f"A message may carry at most {self.max_chars} characters of text."
                    )
                ready = cutter.push(message["text"])
            elif kind in ("flush", "end"):
                ready = cutter.push("") + cutter.flush()
            else:
                raise Refused(
                    POLICY, f'Unknown message {kind!r}: send "text" (with a string "text"), "flush" or "end".'
                )
            for sentence in ready:
                await self.sentences.put(sentence)  # waits while the queue is full: backpressure
            if kind == "end":
                await self.sentences.put(None)
                return

    async def _speak(self, start: StartMessage) -> None:
        """Send the sentences' marks and audio in order, the next sentence already being made while
        the current one is sent, so sentences follow each other without a first-audio wait."""
        encoder = AudioEncoder(start.response_format, self.service.pipeline.sample_rate)
        made: list[asyncio.Task] = []
        index = total = 0
        try:
            current = await self._next_sentence(start, index, made)
            while current is not None:
                text, audio, making = current
                following = asyncio.create_task(self._next_sentence(start, index + 1, made))
                made.append(following)
                await self.websocket.send_json({"type": "sentence.start", "index": index, "text": text})
                samples = 0
                while (chunk := await audio.get()) is not None:
                    samples += len(chunk)
                    await self._send_audio(encoder, chunk)
                await making  # raises what making the sentence raised
                await self.websocket.send_json({"type": "sentence.end", "index": index, "samples": samples})
                index, total = index + 1, total + samples
                current = await following
        finally:
            for task in made:
                task.cancel()  # a sentence being made closes its pipeline stream: its work is aborted
            await asyncio.gather(*made, return_exceptions=True)
        tail = await asyncio.to_thread(encoder.finish)
        if tail:
            await self.websocket.send_bytes(tail)
        await self.websocket.send_json({"type": "done", "sentences": index, "samples": total})

    async def _next_sentence(
        self, start: StartMessage, index: int, made: list[asyncio.Task]
    ) -> tuple[str, asyncio.Queue, asyncio.Task] | None:
        """Wait for the next sentence with something to read and start making its audio: (text, a
        queue of its samples ending with None, the task making them); None after the client's end."""
        while (text := await self.sentences.get()) is not None:
            if not has_nothing_to_read(text):  # a stray mark or emoji between sentences: nothing to say
                break
        if text is None:
            return None
        client = client_key(None, self.websocket.client.host if self.websocket.client else None)
        seed = None if start.seed is None else sentence_seed(start.seed, index)
        request_id = f"{self.request_id}-{index}"
        mode = INSTRUCT if start.instructions else ZERO_SHOT
        request = SynthesisRequest(
            text, self.voice, start.speed, seed, True, client, request_id, mode, start.instructions or None
        )
        audio: asyncio.Queue = asyncio.Queue()
        making = asyncio.create_task(self._make(request, audio))
        made.append(making)
        return text, audio, making

    async def _make(self, request: SynthesisRequest, audio: asyncio.Queue) -> None:
        chunks = self.service.pipeline.stream(request)
        try:
            async for chunk in chunks:
                audio.put_nowait(chunk.samples)
        finally:
            audio.put_nowait(None)  # the sender then awaits this task, which raises what it raised
            await chunks.aclose()

    async def _send_audio(self, encoder: AudioEncoder, samples) -> None:
        inline = encoder.format in ("wav", "pcm")  # a numpy conversion: microseconds a chunk
        data = encoder.push(samples) if inline else await asyncio.to_thread(encoder.push, samples)
        if data:
            await self.websocket.send_bytes(data)  # waits while the client is slow to read

    async def _refuse(self, refused: Refused) -> None:
        log.info("request %s: WebSocket closed with %d: %s", self.request_id, refused.code, refused.message)
        error = {"message": refused.message, "type": refused.kind, "param": refused.param, "code": None}
        try:
            await self.websocket.send_json({"type": "error", "error": error})
            reason = refused.message.encode()[:120].decode(errors="ignore")  # a close reason's limit
            await self.websocket.close(refused.code, reason)
        except (WebSocketDisconnect, RuntimeError):  # the client is already gone
            pass
