"""One replica: a whole Pipeline (its own LM engine and token2wav worker) inside a Ray Serve deployment.

Requests arrive as plain data, the ``SynthesisRequest`` itself: its voice carries the voice's
features (``Voice``), so a voice saved on the page is usable on every replica without a shared store.
Audio goes back as ``AudioChunk``s through a streaming call; a ``UserError`` (a bad text, a full
replica) is yielded as the stream's last item, so it crosses the process boundary as itself and the
ingress raises it, message and kind intact.
"""

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

from cosyapp.engine.pipeline import AudioChunk
from cosyapp.engine.request import SynthesisRequest
from cosyapp.errors import UserError
from cosyapp.options import ServeOptions


class PipelineReplica:
    """The Serve deployment's class: builds its Pipeline on the device Ray gave it (``cuda`` when it
    holds a GPU: Ray sets CUDA_VISIBLE_DEVICES) and starts its engines before Serve counts it ready,
    so a replica (re)started by Serve takes requests only once it can serve them."""

    async def __init__(self, index: int, model_dir: Path, options: ServeOptions, device: str, warm_up: bool):
        from cosyapp.engine.build import build_pipeline, choose_engine
        from cosyapp.models.checkpoint import load_model

        model = await asyncio.to_thread(load_model, model_dir, device=device)
        self.index = index
        self.engine = choose_engine(options.engine, model.device)
        self.pipeline = build_pipeline(model, options)
        await self.pipeline.start(warm_up=warm_up)

    async def stream(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk | UserError]:
        """The request's chunks; a ``UserError`` ends the stream as its last item."""
        try:
            async for chunk in self.pipeline.stream(request):
                yield chunk
        except UserError as error:
            yield error

    async def report(self) -> dict[str, object]:
        """What the ingress routes by and shows: where it runs, its health, load and metrics."""
        import ray

        context = ray.get_runtime_context()
        return {
            "replica": self.index,
            "actor": context.get_actor_name(),
            "node": context.get_node_id(),
            "pid": os.getpid(),
            "device": str(self.pipeline.model.device),
            "engine": self.engine,
            "sample_rate": self.pipeline.sample_rate,
            "health": self.pipeline.health(),
            "queued_jobs": self.pipeline.token2wav.stats().queue_depth,
            "metrics": self.pipeline.metrics.snapshot(),
        }

    async def __del__(self):
        await self.pipeline.shutdown()
