"""The HTTP server of a process: the Gradio UI at ``/`` and, beside it, from the same Service:

    GET  /health            engine state (200 serving, 503 starting / failed / stopped)
    GET  /metrics           Prometheus text from the Pipeline's metrics
    POST /v1/audio/speech   OpenAI-compatible speech: a whole WAV / raw PCM clip, or streamed as produced
    GET  /v1/audio/voices   the voices visible without a session (built-in, model, shared)
    DELETE /v1/audio/voices/{id}   delete a shared saved voice (built-in and model voices stay)

``/v1/*`` sits behind ApiGuard (the API key when one is set, a body size cap); /health and /metrics
are open. Errors are answered as OpenAI's error JSON (``api_errors``). The engines start on the
server's own event loop (the vLLM engine stays bound to it), in the lifespan.
"""

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import gradio as gr
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.middleware import Middleware

from cosyapp.codec import pcm16, wav_header
from cosyapp.engine.build import choose_engine
from cosyapp.engine.pipeline import AudioChunk
from cosyapp.engine.request import SynthesisRequest, check_request
from cosyapp.errors import ParamError, VoiceError
from cosyapp.service import Service
from cosyapp.web.api_errors import HANDLERS, ApiRoute
from cosyapp.web.api_guard import ApiGuard, max_body_bytes
from cosyapp.web.clients import client_key
from cosyapp.web.ui import build_demo, launch_options, mount_options

log = logging.getLogger(__name__)

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
PROMETHEUS_TEXT = "text/plain; version=0.0.4"


class SpeechRequest(BaseModel):
    """Body of POST /v1/audio/speech: OpenAI's fields plus ``seed``. Strict types, no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = "cosyvoice2"  # accepted for OpenAI clients; the one loaded model serves every request
    input: str
    voice: str
    speed: float = 1.0
    response_format: str = "wav"
    stream: bool = False
    seed: int | None = None


@dataclass
class EngineStart:
    """The task starting the engines, so /health can tell starting, failed and serving apart."""

    task: asyncio.Task | None = None

    def state(self, engine_ok: bool) -> str:
        if self.task is None:
            return "not started"
        if not self.task.done():
            return "starting"
        if self.task.cancelled() or self.task.exception() is not None:
            return "failed"
        return "serving" if engine_ok else "stopped"

    def error(self) -> str | None:
        if self.task is None or not self.task.done() or self.task.cancelled():
            return None
        error = self.task.exception()
        return None if error is None else f"{type(error).__name__}: {error}"


class AudioStream(StreamingResponse):
    """Audio chunks sent as the pipeline produces them (a WAV header of unknown length first, for wav).

    The pipeline stream is closed after the response however it ended, so a client that goes away
    aborts its engine work and frees its stream slot at once.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[AudioChunk, None],
        first: AudioChunk | None,
        response_format: str,
        sample_rate: int,
    ):
        self.chunks = chunks
        # Proxies (e.g. the one in front of a Space) must pass chunks on, not buffer the response.
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        body = self._body(first, response_format, sample_rate)
        super().__init__(body, media_type=MEDIA_TYPES[response_format], headers=headers)

    async def _body(
        self, first: AudioChunk | None, response_format: str, sample_rate: int
    ) -> AsyncIterator[bytes]:
        if response_format == "wav":
            yield wav_header(sample_rate, None)
        if first is not None:
            yield pcm16(first.samples)
        async for chunk in self.chunks:
            yield pcm16(chunk.samples)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # the request's scope is cancelled on a disconnect
                await self.chunks.aclose()


def speech_route(service: Service):
    pipeline = service.pipeline

    async def speech(body: SpeechRequest, http: Request) -> Response:
        """Speak ``input`` in ``voice``: 24 kHz mono 16-bit WAV or raw PCM, whole or streamed."""
        if body.response_format not in MEDIA_TYPES:
            supported = ", ".join(MEDIA_TYPES)
            message = f"Unsupported response_format {body.response_format!r}; use one of: {supported}."
            raise ParamError(message, "response_format")
        check_request(body.input, body.speed, body.seed, service.settings.max_text_chars)
        voice = await asyncio.to_thread(service.voices.get, body.voice)
        client = client_key(None, http.client.host if http.client else None)
        request = SynthesisRequest(body.input, voice, body.speed, body.seed, body.stream, client)
        chunks = pipeline.stream(request)
        # A full server raises before the first chunk, while a status can still be sent.
        first = await anext(chunks, None)
        if body.stream:
            return AudioStream(chunks, first, body.response_format, pipeline.sample_rate)
        try:
            pieces = [] if first is None else [pcm16(first.samples)]
            pieces += [pcm16(chunk.samples) async for chunk in chunks]
        finally:
            await chunks.aclose()
        data = b"".join(pieces)
        if body.response_format == "wav":
            data = wav_header(pipeline.sample_rate, len(data)) + data
        return Response(data, media_type=MEDIA_TYPES[body.response_format])

    return speech


def health_route(service: Service, start: EngineStart):
    engine_name = choose_engine(service.settings.engine, service.pipeline.model.device)

    def health() -> JSONResponse:
        """What this process serves with and whether its engines are serving (200) or not (503)."""
        engine = service.pipeline.health()
        state = start.state(bool(engine["ok"]))
        if state == "serving" and engine["lm"] != "serving":
            state = "recovering"  # the LM engine failed and is restarting
        body = {
            "status": state,
            "started": state == "serving",
            "error": start.error(),
            "model": str(service.model_dir),
            "demo": service.demo_reason is not None,
            "demo_reason": service.demo_reason,
            "engine": engine_name,
            "device": str(service.pipeline.model.device),
            "active_streams": engine["active_streams"],
            "waiting": engine["waiting"],
            "lm": engine["lm"],
            "lm_restarts": engine["lm_restarts"],
            "last_fault": engine["last_fault"],
            "max_streams": service.pipeline.max_streams,
        }
        return JSONResponse(body, status_code=200 if state == "serving" else 503)

    return health


def metrics_route(service: Service):
    def metrics() -> PlainTextResponse:
        """The Pipeline's metrics in Prometheus text exposition format."""
        return PlainTextResponse(service.pipeline.metrics.prometheus(), media_type=PROMETHEUS_TEXT)

    return metrics


def voices_route(service: Service):
    def voices() -> dict[str, Any]:
        """The voices an API client can use: built-in, model speakers and shared user voices."""
        data = [
            {"id": v.id, "name": v.name, "kind": v.kind, "language": v.language, "note": v.note}
            for v in service.voices.list_voices(None)
        ]
        return {"object": "list", "data": data}

    return voices


def delete_voice_route(service: Service):
    def delete_voice(voice_id: str) -> dict[str, Any]:
        """Delete the shared saved voice ``voice_id`` (404 for an id not listed, 400 for a built-in
        or model voice); answers OpenAI's deletion object."""
        listed = {info.id: info for info in service.voices.list_voices(None)}
        info = listed.get(voice_id)
        if info is not None and info.kind != "user":
            raise VoiceError(
                f"Voice {voice_id!r} comes with the server and cannot be deleted; only saved voices can."
            )
        service.voices.delete(voice_id, None)
        return {"id": voice_id, "object": "voice", "deleted": True}

    return delete_voice


def app_kwargs(service: Service, wait_for_engines: bool = True) -> dict[str, Any]:
    """FastAPI arguments giving an app the API routes, the error handlers and the engines' lifespan.

    ``wait_for_engines`` False lets the server accept connections while the engines start (requests
    wait for them): Gradio's own launch gives its server only 5 s to come up.
    """
    start = EngineStart()
    pipeline = service.pipeline

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Warm-up pre-selects GPU kernels; on a CPU it only costs minutes (every batch size up to 64).
        warm_up = pipeline.model.device.type != "cpu"
        log.info("starting the engines%s", " with warm-up" if warm_up else "")
        start.task = asyncio.create_task(pipeline.start(warm_up=warm_up))
        if wait_for_engines:
            await start.task
        else:
            start.task.add_done_callback(_log_start_failure)
        try:
            yield
        finally:
            start.task.cancel()
            await asyncio.wait([start.task])
            await pipeline.shutdown()
            log.info("engines stopped")

    routes = [
        ApiRoute("/health", health_route(service, start), methods=["GET"]),
        ApiRoute("/metrics", metrics_route(service), methods=["GET"]),
        ApiRoute("/v1/audio/speech", speech_route(service), methods=["POST"]),
        ApiRoute("/v1/audio/voices", voices_route(service), methods=["GET"]),
        ApiRoute("/v1/audio/voices/{voice_id}", delete_voice_route(service), methods=["DELETE"]),
    ]
    settings = service.settings
    guard = Middleware(ApiGuard, api_key=settings.api_key, max_body=max_body_bytes(settings.max_text_chars))
    return {"lifespan": lifespan, "routes": routes, "exception_handlers": HANDLERS, "middleware": [guard]}


def _log_start_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the engines failed to start; /health reports it", exc_info=task.exception())


def build_app(service: Service) -> FastAPI:
    """The app of ``service``: the API routes, and the Gradio UI of ``build_demo(service)`` at ``/``."""
    app = FastAPI(title="cosyapp", **app_kwargs(service))
    demo = build_demo(service)
    app = gr.mount_gradio_app(app, demo, path="/", **mount_options(demo))
    # Gradio refuses input files from outside its upload folder only once it counts the app as
    # launched; a mounted app never is, and would copy any server file an API call names into its cache.
    demo.has_launched = True
    return app


def launch_shared(service: Service, host: str, port: int) -> None:
    """Serve like ``build_app`` through Gradio's own launch, which alone can open a public share link;
    blocks until interrupted. Offline, Gradio prints "Could not create share link" and serves locally."""
    demo = build_demo(service)
    try:
        demo.launch(
            **launch_options(demo),
            share=True,
            server_name=host,
            server_port=port,
            show_error=True,
            prevent_thread_lock=True,
            app_kwargs=app_kwargs(service, wait_for_engines=False),
        )
    except KeyboardInterrupt:
        # Interrupted while Gradio still waits for the share server (up to 30 s offline): the local
        # server already runs, so close it, which also stops the engines.
        demo.close()
        return
    demo.block_thread()


@contextmanager
def serve_in_thread(app: FastAPI, start_timeout_s: float = 60.0) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread, lifespan included, on a free loopback port; yields its
    base URL and stops it on exit (the soak test and the tests drive the real server this way).
    Raises RuntimeError if the server does not start within ``start_timeout_s``."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
