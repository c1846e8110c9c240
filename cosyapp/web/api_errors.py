"""Errors of the HTTP API (``/v1/*``) as OpenAI's error JSON: the one builder of that object, and
the one mapping of exceptions onto it.

- ``UserError``: its message as it is, 400 (404 for an unknown voice, 503 + Retry-After when busy);
- FastAPI's body errors: 400 for a body that is not JSON, else 422, naming the field;
- anything else: a bug, logged with its traceback and answered 500 with the message "internal error"
  and no details.

Routes are ``ApiRoute``s, which answer their errors themselves: an app-level handler for Exception
answers too, but Starlette then re-raises, and the server drops the client's keep-alive connection.
"""

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse, Response

from cosyapp.errors import BusyError, UserError, VoiceNotFoundError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
INTERNAL_ERROR = "internal error"


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, with ``status``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def user_error_response(error: UserError) -> JSONResponse:
    """The answer to a request the client got wrong, or a full server (503, retry after a second)."""
    if isinstance(error, BusyError):
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        return error_response(503, error.message, "server_busy", error.param, headers=retry)
    if isinstance(error, VoiceNotFoundError):
        return error_response(404, error.message, "not_found_error", error.param)
    return error_response(400, error.message, "invalid_request_error", error.param)


class ApiRoute(APIRoute):
    """A route answering a ``UserError`` as ``user_error_response`` and any other exception (a bug)
    as 500 "internal error", logged with its traceback. FastAPI's own errors (body validation,
    HTTPException) go on to the app's handlers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except UserError as error:
                return user_error_response(error)
            except (RequestValidationError, HTTPException):
                raise
            except Exception:
                request_id = request.scope.get("state", {}).get("request_id")
                log.exception("request %s: %s %s failed", request_id, request.method, request.url.path)
                return error_response(500, INTERNAL_ERROR, "server_error")

        return answer


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's body errors of the API in OpenAI's shape: 400 for a body that is not JSON, else 422.

    Other routes (Gradio's, when it serves the app itself) keep FastAPI's answer."""
    if not request.url.path.startswith("/v1/"):
        return await request_validation_exception_handler(request, exc)
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", "")
        return error_response(400, f"the body is not valid JSON: {reason}".rstrip(": "))
    fields = [str(part) for part in error["loc"] if part != "body"]
    param = ".".join(fields) or None
    if param:
        message = f"{param}: {error['msg']}"
    elif error["type"] == "missing":
        message = "the body is empty: send a JSON object with at least input and voice"
    else:
        message = f"the body must be a JSON object (Content-Type: application/json): {error['msg']}"
    return error_response(422, message, param=param)


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug outside any route (a middleware's): 500 without details; Starlette re-raises ``exc``
    afterwards, so the server logs its traceback."""
    return error_response(500, INTERNAL_ERROR, "server_error")


HANDLERS = {RequestValidationError: validation_error, Exception: internal_error}
