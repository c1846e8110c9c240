"""POST /v1/audio/conversions: voice conversion, the speech of a recording said again in a voice.

A multipart form: ``file`` (the speech to convert, 1-30 s, at least 16 kHz, any format a voice
upload takes), ``voice`` (an id from GET /v1/audio/voices), and optionally ``response_format``,
``stream`` (true/false), ``stream_format`` (audio or sse), ``speed`` and ``seed``, answered as
/v1/audio/speech answers (``speech.audio_response``): the whole file, its bytes as they are made, or
OpenAI's speech events. The recording goes through the speech tokenizer (25 tokens a second, in a
thread) and its tokens straight to token2wav in the voice's prompt: no LM, so the output lasts as
long as the source (960 samples per token) divided by ``speed``.

Every user mistake answers OpenAI's error JSON naming the form field (``file``, ``voice``, ...).
"""

import asyncio

from fastapi import Request
from fastapi.responses import Response

from cosyapp.codec import FORMATS
from cosyapp.engine.request import SynthesisRequest, check_options
from cosyapp.errors import ParamError
from cosyapp.frontend.modes import VOICE_CONVERSION
from cosyapp.frontend.source import source_tokens
from cosyapp.service import Service
from cosyapp.web.clients import client_key
from cosyapp.web.request_ids import request_id_of
from cosyapp.web.speech import STREAM_FORMATS, audio_response
from cosyapp.web.voices_api import read_form

CONVERSION_PATH = "/v1/audio/conversions"
FIELDS = ("file", "voice", "model", "response_format", "stream", "stream_format", "speed", "seed")
BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def conversion_route(service: Service):
    pipeline = service.pipeline
    max_mb = service.settings.max_upload_mb

    async def conversion(http: Request) -> Response:
        """Say the speech of ``file`` in ``voice`` as ``response_format`` (24 kHz mono)."""
        form = await read_form(http, FIELDS, required=("file", "voice"))
        fields = {key: _text(form, key) for key in FIELDS if key != "file"}
        response_format = fields["response_format"] or "wav"
        stream_format = fields["stream_format"] or "audio"
        for name, value, allowed in [
            ("response_format", response_format, FORMATS),
            ("stream_format", stream_format, STREAM_FORMATS),
        ]:
            if value not in allowed:
                raise ParamError(f"Unsupported {name} {value!r}; use one of: {', '.join(allowed)}.", name)
        stream = fields["stream"].lower() or "false"
        if stream not in BOOLEANS:
            raise ParamError(f"The field 'stream' must be true or false, got {stream!r}.", "stream")
        speed, seed = _number(fields["speed"], float, 1.0), _number(fields["seed"], int, None)
        check_options(speed, seed)
        voice = await asyncio.to_thread(service.voices.get, fields["voice"], None)
        data = await form["file"].read()
        tokens = await asyncio.to_thread(source_tokens, service.voices.frontend, data, max_mb)
        request = SynthesisRequest(
            "",
            voice,
            speed,
            seed,
            # As on /v1/audio/speech: naming a stream format asks for a stream.
            BOOLEANS[stream] or bool(fields["stream_format"]),
            client_key(None, http.client.host if http.client else None),
            request_id_of(http),
            mode=VOICE_CONVERSION,
            source_tokens=tokens,
        )
        return await audio_response(http, pipeline, request, response_format, stream_format)

    return conversion


def _text(form: dict, key: str) -> str:
    value = form.get(key, "")
    if not isinstance(value, str):
        raise ParamError(f"The field {key!r} must be text, not a file.", key)
    return value.strip()


def _number(text: str, kind: type, default: float | int | None) -> object:
    """``text`` as ``kind``, ``default`` when empty, else ``text`` itself, which ``check_options``
    then refuses with the request rules' message."""
    if not text:
        return default
    try:
        return kind(text)
    except ValueError:
        return text
