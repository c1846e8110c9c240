"""The HTTP server of a process: the Gradio UI at ``/`` and, beside it, from the same Service:

    GET  /health            engine state (200 serving, 503 starting / failed / stopped)
    GET  /metrics           Prometheus text from the Pipeline's metrics
    POST /v1/audio/speech   OpenAI-compatible speech in every OpenAI format, whole or streamed (speech.py)
    GET  /v1/audio/voices   the voices visible without a session (built-in, model, shared)
    DELETE /v1/audio/voices/{id}   delete a shared saved voice (built-in and model voices stay)
    POST /v1/audio/voices, GET /v1/audio/voices/{id}[/audio], POST /v1/audio/transcriptions
                            voices from uploads and their transcription (voices_api.py)
    POST /v1/audio/conversions   voice conversion: a recording's speech in a voice (conversion.py)
    GET  /v1/audio/voices/{id}/preview, /voice-previews   a voice's preview (previews.py)
    WS   /v1/audio/speech/stream   text deltas in, each sentence's audio out as it is made (ws.py)

In front of the routes, outermost first: ``RequestIds`` (X-Request-Id, one log line per request),
``ApiCors`` (with ``--cors-origins``), ``ApiGuard`` (on /v1/*: the API key when one is set, a body
size cap), ``RouteGuard`` (405 with Allow, 404 for unknown /v1 paths). Errors are answered as
OpenAI's error JSON (``api_errors``). The engines start on the server's own event loop (the vLLM
engine stays bound to it), in the lifespan.
"""

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import gradio as gr
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.middleware import Middleware
from starlette.routing import WebSocketRoute

from cosyapp.engine.build import choose_engine
from cosyapp.errors import VoiceError
from cosyapp.service import Service
from cosyapp.web.api_errors import HANDLERS, ApiRoute
from cosyapp.web.api_guard import ApiGuard, max_body_bytes, upload_body_bytes
from cosyapp.web.conversion import CONVERSION_PATH, conversion_route
from cosyapp.web.cors import ApiCors
from cosyapp.web.previews import preview_routes
from cosyapp.web.request_ids import RequestIds
from cosyapp.web.route_guard import RouteGuard
from cosyapp.web.speech import speech_route
from cosyapp.web.ui import build_demo, launch_options, mount_options
from cosyapp.web.voices_api import UPLOAD_PATHS, voice_routes
from cosyapp.web.ws import speech_stream_route

log = logging.getLogger(__name__)

PROMETHEUS_TEXT = "text/plain; version=0.0.4"


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


def health_route(service: Service, start: EngineStart):
    engine_name = choose_engine(service.settings.engine, service.pipeline.device)

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
            "device": str(service.pipeline.device),
            "active_streams": engine["active_streams"],
            "waiting": engine["waiting"],
            "lm": engine["lm"],
            "lm_restarts": engine["lm_restarts"],
            "last_fault": engine["last_fault"],
            "max_streams": service.pipeline.max_streams,
            "sizing": service.settings.card.report() if service.settings.card else None,
            **({"replicas": engine["replicas"]} if "replicas" in engine else {}),  # --replicas
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
        warm_up = pipeline.device.type != "cpu"
        log.info("starting the engines%s", " with warm-up" if warm_up else "")
        start.task = asyncio.create_task(pipeline.start(warm_up=warm_up))
        if wait_for_engines:
            await start.task
        else:
            start.task.add_done_callback(_log_start_failure)
        await service.previews.start()  # made while the engines are otherwise idle
        try:
            yield
        finally:
            await service.previews.stop()
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
        *voice_routes(service),
        *preview_routes(service),
        ApiRoute(CONVERSION_PATH, conversion_route(service), methods=["POST"]),
        WebSocketRoute("/v1/audio/speech/stream", speech_stream_route(service)),
    ]
    settings = service.settings
    middleware = [
        Middleware(RequestIds),
        *([Middleware(ApiCors, origins=settings.cors_origins)] if settings.cors_origins else []),
        Middleware(
            ApiGuard,
            api_key=settings.api_key,
            max_body=max_body_bytes(settings.max_text_chars),
            upload_paths=(*UPLOAD_PATHS, CONVERSION_PATH),
            max_upload=upload_body_bytes(settings.max_upload_mb),
        ),
        Middleware(RouteGuard, routes=routes),
    ]
    return {"lifespan": lifespan, "routes": routes, "exception_handlers": HANDLERS, "middleware": middleware}


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
    # Connections a client left open (an event stream, a keep-alive) get a few seconds, then closed.
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
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
