"""CORS for the API, off unless ``--cors-origins`` names the browser origins allowed to call it.

Only the API paths get these headers; the Gradio UI, served from its own origin, keeps Gradio's.
"""

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from cosyapp.web.request_ids import HEADER, is_api_path


class ApiCors:
    """ASGI middleware: Starlette's CORS for the API paths, for ``origins`` (``*``: any origin)."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...]):
        self.app = app
        self.cors = CORSMiddleware(
            app,
            allow_origins=list(origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["authorization", "content-type", HEADER],
            expose_headers=[HEADER],
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.cors if scope["type"] == "http" and is_api_path(scope["path"]) else self.app
        await handler(scope, receive, send)
