"""The gate in front of the HTTP API (``/v1/*``): the API key, then a cap on the request body (a
larger one, the upload limit, on the paths that take a recording).

It runs before FastAPI reads the body, so a client without the key, or with a body far larger than
any valid request, is answered at once without the server holding that body. Every other path
(the UI, /health, /metrics) passes untouched.
"""

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyapp.web.api_errors import error_response

API_PREFIX = "/v1/"
# JSON may escape one character of text as a surrogate pair ("\ud83d\ude00", 12 bytes); the other
# fields of a request take a few hundred bytes.
BYTES_PER_TEXT_CHAR = 12
OTHER_FIELDS_BYTES = 2**16


def max_body_bytes(max_text_chars: int) -> int:
    """The largest body a valid request with at most ``max_text_chars`` characters of text can have."""
    return BYTES_PER_TEXT_CHAR * max_text_chars + OTHER_FIELDS_BYTES


def upload_body_bytes(max_upload_mb: float) -> int:
    """The largest multipart body carrying a recording of at most ``max_upload_mb`` MiB."""
    return int(max_upload_mb * 2**20) + OTHER_FIELDS_BYTES


class ApiGuard:
    """ASGI middleware for ``/v1/*``: 401 without the right ``Authorization: Bearer <api_key>`` (when
    ``api_key`` is set; WebSocket handshakes too), 413 for a body over ``max_body`` bytes."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body: int,
        upload_paths: tuple[str, ...] = (),
        max_upload: int = 0,
    ):
        self.app = app
        self.api_key = api_key
        self.max_body = max_body
        self.upload_paths, self.max_upload = upload_paths, max_upload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._check_key(headers.get("authorization"))
        if scope["type"] == "websocket":  # the handshake is refused with the same 401; no body to cap
            await (self.app if refusal is None else refusal)(scope, receive, send)
            return
        length = headers.get("content-length")
        limit = self.max_upload if scope["path"] in self.upload_paths else self.max_body
        if refusal is None and length is not None and (not length.isdigit() or int(length) > limit):
            refusal = self._too_large(limit)
        if refusal is None and length is None:
            # A chunked body announces no length: read it here, up to the limit, and hand it on.
            body, refusal = await self._read_body(receive, limit)
            receive = _replay(body, receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check_key(self, authorization: str | None) -> JSONResponse | None:
        if self.api_key is None:
            return None
        challenge = {"WWW-Authenticate": "Bearer"}
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            message = "Missing API key: send it in the header 'Authorization: Bearer <key>'."
            return error_response(401, message, code="missing_api_key", headers=challenge)
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            return error_response(401, "Invalid API key.", code="invalid_api_key", headers=challenge)
        return None

    def _too_large(self, limit: int) -> JSONResponse:
        message = f"The request body is larger than {limit:,} bytes, more than any valid request."
        return error_response(413, message, code="request_too_large")

    async def _read_body(self, receive: Receive, limit: int) -> tuple[bytes, JSONResponse | None]:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return b"", self._too_large(limit)
            more = message.get("more_body", False)
        return b"".join(chunks), None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the real one (for disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
