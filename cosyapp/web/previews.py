"""Voice previews over HTTP, both answered from the same stored files (``cosyapp/previews.py``):

    GET /v1/audio/voices/{id}/preview   the API's: voices visible without a browser key (built-in,
                                        model, shared), behind the API key like all of /v1
    GET /voice-previews?voice=&model=&sig=   the page's: a URL the gallery signed for a voice its
                                        page lists, so a private voice's preview reaches its owner only

A preview not made yet is made on the spot (once, however many ask at the same time), so the first
request for a voice takes a synthesis and every later one none. Both answer a 16-bit WAV with an
ETag of the voice and model (``If-None-Match`` gets a 304); the API's URL names no model, so clients
revalidate (``no-cache``), while the page's names it and is kept by the browser for a day.
"""

import asyncio
import hashlib

from fastapi import Request
from fastapi.responses import Response

from cosyapp.errors import VoiceNotFoundError
from cosyapp.previews import PAGE_PATH
from cosyapp.service import Service
from cosyapp.web.api_errors import ApiRoute

PAGE_MAX_AGE_S = 86_400


def preview_routes(service: Service) -> list[ApiRoute]:
    """The API's and the page's preview routes over ``service``'s previews."""
    return [
        ApiRoute("/v1/audio/voices/{voice_id}/preview", api_preview_route(service), methods=["GET"]),
        ApiRoute(PAGE_PATH, page_preview_route(service), methods=["GET"]),
    ]


def api_preview_route(service: Service):
    async def voice_preview(voice_id: str, request: Request) -> Response:
        """The preview of a voice visible without a browser key, as WAV (404 for any other id)."""
        data = await service.previews.audio(voice_id, None)
        return _answer(request, data, _etag(service, voice_id), "no-cache")

    return voice_preview


def page_preview_route(service: Service):
    async def page_preview(request: Request, voice: str = "", model: str = "", sig: str = "") -> Response:
        """The preview behind a URL the gallery signed; 404 for a URL it did not sign or signed for
        another model (the page lists the voices again when reloaded)."""
        if not service.previews.signed(voice, model, sig):
            raise VoiceNotFoundError(voice)
        owner = await asyncio.to_thread(service.voices.owner_of, voice)
        data = await service.previews.audio(voice, owner)
        return _answer(request, data, _etag(service, voice), f"private, max-age={PAGE_MAX_AGE_S}")

    return page_preview


def _etag(service: Service, voice_id: str) -> str:
    return f'"{hashlib.sha256(voice_id.encode()).hexdigest()[:16]}-{service.previews.fingerprint}"'


def _answer(request: Request, data: bytes, etag: str, cache: str) -> Response:
    headers = {"ETag": etag, "Cache-Control": cache}
    if etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(data, media_type="audio/wav", headers=headers)
