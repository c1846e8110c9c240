"""Answers for requests no API route takes, in the API's error JSON: 405 with ``Allow`` for a route's
path asked with another method, 404 for an unknown ``/v1/`` path, 426 for plain HTTP to a WebSocket
route. Without it the Gradio app mounted at ``/`` would answer them with its own 404 page.

Browsers' CORS preflights (``OPTIONS``) are answered before this, when ``--cors-origins`` allows them.
"""

from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from cosyapp.web.api_errors import error_response
from cosyapp.web.request_ids import is_api_path


class RouteGuard:
    """ASGI middleware over the API ``routes``; every other path passes untouched."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute]):
        self.app = app
        self.http = [r for r in routes if isinstance(r, Route)]
        self.websocket = [r for r in routes if isinstance(r, WebSocketRoute)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        allowed = {m for r in self.http if r.path_regex.fullmatch(path) for m in r.methods or ()}
        if method in allowed:
            await self.app(scope, receive, send)
            return
        if allowed:
            allow = ", ".join(sorted(allowed))
            message = f"Method {method} is not allowed on {path}; use {allow}."
            answer = error_response(405, message, code="method_not_allowed", headers={"Allow": allow})
        elif any(r.path_regex.fullmatch(path) for r in self.websocket):
            message = f"{path} is a WebSocket endpoint: connect with a WebSocket client (ws:// or wss://)."
            answer = error_response(426, message, code="upgrade_required", headers={"Upgrade": "websocket"})
        else:
            answer = error_response(404, f"No API endpoint at {path}.", "not_found_error", code="unknown_url")
        await answer(scope, receive, send)
