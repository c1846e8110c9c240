"""A request id for every API request: ``X-Request-Id`` on its response and in the server's log.

The client's own ``X-Request-Id`` is kept when it is a plain token (letters, digits, ``-_.``, up to
64 characters), so a caller can follow its request through the log; otherwise a fresh one is made.
The id also names the request in the Pipeline (its LM request ids, its metrics record).
"""

import logging
import re
import time
import uuid

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

HEADER = "x-request-id"
_TOKEN = re.compile(r"[A-Za-z0-9._-]{1,64}")
_STARTS = ("http.response.start", "websocket.accept", "websocket.http.response.start")


def request_id_of(connection: HTTPConnection) -> str:
    """The id ``RequestIds`` gave this request (a fresh one where it did not run)."""
    return connection.scope.setdefault("state", {}).setdefault("request_id", uuid.uuid4().hex)


def is_api_path(path: str) -> bool:
    """The paths of the HTTP API and the server's own endpoints (not the Gradio UI's)."""
    return path.startswith("/v1/") or path in ("/health", "/metrics")


class RequestIds:
    """ASGI middleware: give each API request (HTTP or WebSocket) an id, answer it in ``X-Request-Id``
    and log one line per request: id, method, path, status, duration."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(HEADER, "")
        request_id = given if _TOKEN.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started, status = time.monotonic(), None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] in _STARTS:
                status = message.get("status", 101)
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                message = {**message, "headers": [*headers, (HEADER.encode(), request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            method = scope.get("method", "WEBSOCKET")
            elapsed_ms = 1000 * (time.monotonic() - started)
            path = scope["path"]
            log.info("request %s: %s %s -> %s in %.0f ms", request_id, method, path, status, elapsed_ms)
