"""Voices and transcription through the HTTP API, in the shared voice library the page uses:

    POST /v1/audio/voices            multipart ``file``, ``name``, ``transcript`` (optional: the
                                     recording is transcribed) -> a shared voice for /v1/audio/speech
    GET  /v1/audio/voices/{id}       a voice's name, kind, language, transcript and prompt length
    GET  /v1/audio/voices/{id}/audio the recording the voice was made from, as WAV
    POST /v1/audio/transcriptions    OpenAI's transcription request (``file``, ``language``,
                                     ``response_format`` json, text or verbose_json)

An upload is read as the page reads one: any format ``load_prompt_audio`` decodes, at most
``--max-upload-mb``, prepared by ``frontend/prepare.py`` (silence trimmed, the best 15 s of a long
recording, levelled). Every user mistake answers OpenAI's error JSON with the page's message and the
form field at fault as ``param``. Decoding, preparing and feature extraction run in threads, the
transcription in the ASR thread: the event loop only waits.
"""

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import UploadFile

from cosyapp.asr.transcriber import available
from cosyapp.asr.whisper import LANGUAGES, Transcript
from cosyapp.codec import wav
from cosyapp.errors import ParamError, UserError
from cosyapp.frontend.audio import MAX_PROMPT_SECONDS, PromptAudio, load_prompt_audio
from cosyapp.frontend.prepare import PreparedPrompt, read_upload
from cosyapp.frontend.voice_rules import check_prompt_text, sanitize_name
from cosyapp.frontend.voices import Voice
from cosyapp.service import Service
from cosyapp.web.api_errors import ApiRoute

# The paths whose bodies carry a recording: ApiGuard lets them reach the upload limit.
UPLOAD_PATHS = ("/v1/audio/voices", "/v1/audio/transcriptions")
VOICE_FIELDS = ("file", "name", "transcript")
TRANSCRIPTION_FIELDS = ("file", "model", "language", "response_format", "prompt", "temperature")
TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json")
# A transcript from the random-weight demo model is text of no meaning; clients are told so.
DEMO_SOURCE, ASR_SOURCE, GIVEN_SOURCE = "demo-asr", "asr", "given"
TOKEN_RATE = 25  # speech tokens per second of prompt (docs/model.md §3.4)


def voice_routes(service: Service) -> list[ApiRoute]:
    """The routes of this module over ``service``'s voice library and speech recogniser."""
    return [
        ApiRoute("/v1/audio/voices", create_voice_route(service), methods=["POST"]),
        ApiRoute("/v1/audio/voices/{voice_id}", get_voice_route(service), methods=["GET"]),
        ApiRoute("/v1/audio/voices/{voice_id}/audio", voice_audio_route(service), methods=["GET"]),
        ApiRoute("/v1/audio/transcriptions", transcription_route(service), methods=["POST"]),
    ]


def create_voice_route(service: Service):
    max_mb = service.settings.max_upload_mb

    async def create_voice(request: Request) -> dict[str, Any]:
        """Save a shared voice from a recording; its transcript is transcribed when not given."""
        form = await read_form(request, VOICE_FIELDS, required=("file", "name"))
        name = _text_field(form, "name")
        transcript = _text_field(form, "transcript")
        try:
            name = sanitize_name(name)
        except UserError as error:
            raise ParamError(error.message, "name") from None
        prepared = await _prepare(form["file"], max_mb)
        source, language = GIVEN_SOURCE, ""
        if transcript.strip():
            transcript = _checked_transcript(transcript, prepared.audio)
        else:
            heard = await available(service.asr).transcribe_async(prepared.audio)
            transcript = _checked_transcript(heard.text, prepared.audio)
            source, language = (DEMO_SOURCE if heard.demo else ASR_SOURCE), heard.language
        info = await asyncio.to_thread(
            service.voices.save, name, prepared.audio, transcript, None, shared=True, language=language
        )
        voice = await asyncio.to_thread(service.voices.get, info.id, None)
        return voice_object(voice) | {"transcript_source": source, "prepared": prepared.summary()}

    return create_voice


def get_voice_route(service: Service):
    async def get_voice(voice_id: str) -> dict[str, Any]:
        """A voice visible without a session (404 for any other id)."""
        return voice_object(await asyncio.to_thread(service.voices.get, voice_id, None))

    return get_voice


def voice_audio_route(service: Service):
    async def voice_audio(voice_id: str) -> Response:
        """The recording ``voice_id`` was made from, as 16-bit WAV."""
        audio = await asyncio.to_thread(service.voices.recording, voice_id, None)
        return Response(wav(audio.samples, audio.sample_rate), media_type="audio/wav")

    return voice_audio


def transcription_route(service: Service):
    max_mb = service.settings.max_upload_mb

    async def transcription(request: Request) -> Response:
        """OpenAI's transcription of a recording of at most 30 s with the prompt recogniser."""
        form = await read_form(request, TRANSCRIPTION_FIELDS, required=("file",))
        language = _text_field(form, "language") or None
        if language is not None and language not in LANGUAGES:
            message = f"Unsupported language {language!r}; use one of: {', '.join(LANGUAGES)}."
            raise ParamError(message, "language")
        response_format = _text_field(form, "response_format") or "json"
        if response_format not in TRANSCRIPTION_FORMATS:
            allowed = ", ".join(TRANSCRIPTION_FORMATS)
            message = f"Unsupported response_format {response_format!r}; use one of: {allowed}."
            raise ParamError(message, "response_format")
        asr = available(service.asr)
        audio = await _read(form["file"], max_mb, MAX_PROMPT_SECONDS)
        heard = await asr.transcribe_async(audio, language)
        return transcription_answer(heard, audio, response_format)

    return transcription


def transcription_answer(heard: Transcript, audio: PromptAudio, response_format: str) -> Response:
    """OpenAI's answer in ``response_format``; ``demo`` marks the demo model's meaningless text."""
    if response_format == "text":
        return PlainTextResponse(heard.text)
    answer: dict[str, Any] = {"text": heard.text, "demo": heard.demo}
    if response_format == "verbose_json":
        answer |= {"task": "transcribe", "language": heard.language, "duration": round(audio.seconds, 3)}
    return JSONResponse(answer)


def voice_object(voice: Voice) -> dict[str, Any]:
    """The API's view of a voice; ``seconds`` is the length of its prompt the model conditions on."""
    info = voice.info
    return {
        "id": info.id,
        "object": "voice",
        "name": info.name,
        "kind": info.kind,
        "language": info.language,
        "note": info.note,
        "transcript": voice.prompt_text if voice.prompt_ids is None else None,
        "seconds": round(len(voice.features.speech_tokens) / TOKEN_RATE, 2),
    }


async def read_form(request: Request, fields: tuple[str, ...], required: tuple[str, ...]) -> dict:
    """The multipart form of ``request`` with only ``fields``, each at most once. Raises ``ParamError``
    for another body, an unknown or repeated field, or a missing required one."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ParamError(
            f"Send the request as multipart/form-data with the fields {', '.join(fields)}.", None
        )
    try:
        form = await request.form(max_files=1, max_fields=len(fields))
    except Exception as error:  # python-multipart's and Starlette's parse errors have no common base
        raise ParamError(f"The multipart body cannot be read: {error}.", None) from error
    values = {}
    for key, value in form.multi_items():
        if key not in fields:
            raise ParamError(f"Unknown field {key!r}; this endpoint takes {', '.join(fields)}.", key)
        if key in values:
            raise ParamError(f"The field {key!r} is sent twice.", key)
        values[key] = value
    for key in required:
        if key not in values:
            what = "the recording as a file" if key == "file" else "it"
            raise ParamError(f"The field {key!r} is missing: send {what}.", key)
    if not isinstance(values["file"], UploadFile):
        raise ParamError("The field 'file' must be a file (multipart with a filename).", "file")
    return values


def _text_field(form: dict, key: str) -> str:
    value = form.get(key, "")
    if not isinstance(value, str):
        raise ParamError(f"The field {key!r} must be text, not a file.", key)
    return value


async def _read(upload: UploadFile, max_mb: float, max_seconds: float) -> PromptAudio:
    """The decoded recording of an uploaded file; its user errors name the field ``file``."""
    data = await upload.read()
    return await _as_file_error(asyncio.to_thread(load_prompt_audio, data, max_mb, max_seconds=max_seconds))


async def _prepare(upload: UploadFile, max_mb: float) -> PreparedPrompt:
    """The prepared prompt of an uploaded file; its user errors name the field ``file``."""
    data = await upload.read()
    return await _as_file_error(asyncio.to_thread(read_upload, data, max_mb))


async def _as_file_error(work):
    try:
        return await work
    except UserError as error:
        error.param = "file"
        raise


def _checked_transcript(text: str, audio: PromptAudio) -> str:
    try:
        return check_prompt_text(text, audio)
    except UserError as error:
        error.param = "transcript"
        raise
