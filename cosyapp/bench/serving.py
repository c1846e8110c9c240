"""The server the HTTP drivers talk to: by default the benchmark's own, else one given by ``--url``.

The own server is the app of ``cosyapp.web.server.build_app`` over the benchmark's Pipeline, served by
uvicorn on a free loopback port on this event loop (the loop the engines run on, as in production),
so one run holds everything and the engines' statistics stay readable here. gradio, uvicorn and the
server code are imported only when a server is started.
"""

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cosyapp.engine.pipeline import Pipeline
from cosyapp.frontend.features import VoiceFeatures

if TYPE_CHECKING:
    from cosyapp.frontend.audio import PromptAudio


class FrontendOnFirstUse:
    """The folder's VoiceFrontend, built when a recording first needs its features: it needs librosa,
    which the GPU machine may lack, and the benchmark's voice (a folder speaker) needs no frontend."""

    def __init__(self, model_dir: Path, device: torch.device):
        self.model_dir = model_dir
        self.device = device
        self._frontend = None

    def features(self, audio: "PromptAudio") -> VoiceFeatures:
        """Features of a validated recording (see ``VoiceFrontend.features``)."""
        if self._frontend is None:
            from cosyapp.frontend.voice import VoiceFrontend

            self._frontend = VoiceFrontend(self.model_dir, self.device)
        return self._frontend.features(audio)


@asynccontextmanager
async def own_server(pipeline: Pipeline, model_dir: Path, workdir: Path, engine: str) -> AsyncIterator[str]:
    """Serve ``pipeline`` with the voices of ``model_dir`` (its ``spk2info.pt`` speakers among them);
    yields the base URL. The server's shutdown also stops the Pipeline's engines."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import uvicorn

    from cosyapp.frontend.voices import VoiceLibrary
    from cosyapp.service import Service
    from cosyapp.settings import Settings
    from cosyapp.web.server import build_app

    settings = Settings(
        model=str(model_dir),
        engine=engine,
        device=str(pipeline.model.device),
        max_streams=pipeline.max_streams,
        cache_dir=workdir / "cache",
        data_dir=workdir / "data",
    )
    frontend = FrontendOnFirstUse(model_dir, pipeline.model.device)
    voices = VoiceLibrary(settings.data_dir, frontend, spk2info=model_dir / "spk2info.pt")
    service = Service(settings, pipeline, voices, model_dir, demo_reason="benchmark model, random weights")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # Forwarded addresses are trusted from loopback only (the OpenAI driver's simulated users); Gradio
    # clients keep event streams open, so shutdown does not wait long for them.
    config = uvicorn.Config(
        build_app(service),
        log_level="warning",
        access_log=False,
        proxy_headers=True,
        forwarded_allow_ips="127.0.0.1",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it
                raise RuntimeError("the benchmark's server stopped while starting")
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        try:
            await task
        finally:
            sock.close()


def check_external(url: str, voice_id: str) -> None:
    """Raise ValueError, saying what to do, when the server at ``url`` is unreachable or lacks the
    benchmark voice."""
    import httpx

    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/audio/voices", timeout=30)
        response.raise_for_status()
    except httpx.HTTPError as e:
        raise ValueError(f"could not list the voices of {url}: {e}") from None
    if voice_id not in {voice["id"] for voice in response.json()["data"]}:
        raise ValueError(
            f"{url} does not offer the voice {voice_id!r}: serve the benchmark's model folder "
            "(e.g. app.py --model WORKDIR/full-size, written by a run with the same --workdir)"
        )
