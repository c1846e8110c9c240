"""The Pipeline: one per process, shared by every session, from a request to streamed audio.

    request -> text frontend (sentences, ids) -> per sentence: prompt embeddings -> LM engine
    (batched across all requests) -> token2wav worker (batched across all streams) -> audio chunks

Admission control (``admission.FairAdmission``) bounds the streams in flight and the requests
waiting, and shares the slots fairly across clients; cancellation (closing the iterator, or
cancelling the task that consumes it) aborts the LM request and drops pending token2wav work; an
error in one request ends only that request.

The event loop that runs every stream never waits on CPU work: text preparation runs in
``TextWorkers`` and prompt embeddings in a thread.
"""

import asyncio
import contextlib
import functools
import hashlib
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import numpy as np
import torch

from cosyapp.engine.admission import BusyError as BusyError  # callers take it with the Pipeline
from cosyapp.engine.admission import FairAdmission
from cosyapp.engine.lm.base import LMRequest, SpeechTokenLM
from cosyapp.engine.metrics import Metrics, RequestRecord
from cosyapp.engine.request import MAX_SEED, SynthesisRequest
from cosyapp.engine.request import MAX_SPEED as MAX_SPEED  # the limits, for callers of the Pipeline
from cosyapp.engine.request import MIN_SPEED as MIN_SPEED
from cosyapp.engine.text_workers import TextWorkers
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.frontend.text import TextFrontend
from cosyapp.models.cosyvoice2 import CosyVoice2, PromptInputs
from cosyapp.options import DEFAULTS


@dataclass(frozen=True)
class AudioChunk:
    """Consecutive float32 samples (N,) at ``sample_rate``; ``sentence`` is the sentence index."""

    samples: np.ndarray
    sample_rate: int
    sentence: int


def sentence_seed(seed: int, index: int) -> int:
    """A per-sentence seed derived from the request seed (independent streams per sentence)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_SEED


class Pipeline:
    """Serves every session from one LM engine and one token2wav worker."""

    def __init__(
        self,
        model: CosyVoice2,
        text: TextFrontend,
        lm: SpeechTokenLM,
        token2wav: Token2Wav,
        max_streams: int = DEFAULTS.max_streams,
        max_waiting: int = DEFAULTS.max_waiting,
        metrics: Metrics | None = None,
    ):
        self.model = model
        self.text = text
        self.text_workers = TextWorkers(text)
        self.lm = lm
        self.token2wav = token2wav
        self.metrics = metrics or Metrics()
        self.admission = FairAdmission(max_streams, max_waiting, on_reject=self.metrics.rejected)
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self.metrics.gauges.update(
            queue_depth=lambda: self.admission.waiting,
            lm_batch_size=lambda: self.lm.stats().last_batch_size,
            lm_max_batch_size=lambda: self.lm.stats().max_batch_size,
            token2wav_batch_size=lambda: self.token2wav.stats().last_flow_batch,
            token2wav_max_batch_size=lambda: self.token2wav.stats().max_flow_batch,
            gpu_memory_gb=_gpu_memory_gb,
        )

    @property
    def max_streams(self) -> int:
        return self.admission.max_streams

    @property
    def max_waiting(self) -> int:
        return self.admission.max_waiting

    @property
    def sample_rate(self) -> int:
        return self.model.sample_rate

    async def start(self, warm_up: bool = False) -> None:
        """Start the engines on the running event loop (idempotent; the first request starts them too).

        ``warm_up`` also runs token2wav at every batch size it will see, so first requests do not pay
        for kernel selection and allocator growth. The vLLM engine stays bound to this loop.
        """
        self._start_lock = self._start_lock or asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            await self.lm.start()
            await self.text_workers.start()
            await asyncio.to_thread(self.token2wav.capture_graphs)
            self.token2wav.start()
            self._started = True
            if warm_up:
                await self.warm_up_token2wav()

    async def warm_up_token2wav(self) -> None:
        """Streaming and whole-clip token2wav for 1, 2, 4, ... up to max_batch streams at once.

        A 10.4 s sentence, so streams go through first, middle (100-token) and final chunks, and the
        incremental flow's graphs of those shapes are captured here rather than during requests."""
        g = torch.Generator().manual_seed(0)
        prompt = PromptInputs(
            text_ids=torch.zeros(1, dtype=torch.long),
            speech_tokens=torch.randint(0, 6561, (75,), generator=g),
            speech_feat=torch.randn(150, 80, generator=g) - 5.0,
            embedding=torch.randn(192, generator=g),
        )
        tokens = torch.randint(0, 6561, (260,), generator=g).tolist()

        async def streamed() -> None:
            async def feed():
                yield tokens

            async for _ in self.token2wav.open_stream(prompt, streaming=True, seed=0).run(feed()):
                pass

        batch = 1
        while batch <= self.token2wav.max_batch:
            # Each group's first jobs reach the worker together, so every batch size is really run.
            await self.token2wav.together([streamed() for _ in range(batch)], batch)
            await self.token2wav.together(
                [self.token2wav.whole_clip(prompt, tokens, seed=0) for _ in range(batch)], batch
            )
            batch *= 2

    async def shutdown(self) -> None:
        """Stop the engines (idempotent)."""
        if self._started:
            self._started = False
            self.token2wav.stop()
            self.text_workers.close()
            await self.lm.shutdown()

    def health(self) -> dict[str, object]:
        """Engine state for /health: started, the LM engine's state (serving or restarting), its
        restarts and latest fault, active streams, waiting requests, clients served."""
        lm = self.lm.stats()
        return {
            "ok": self._started,
            "lm": lm.state,
            "lm_restarts": lm.restarts,
            "last_fault": lm.last_fault,
            "active_streams": self.admission.active,
            "waiting": self.admission.waiting,
            "clients": self.admission.clients(),
        }

    async def stream(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Audio of ``request`` as it is produced (one chunk per sentence when not streaming).

        Raises a ``UserError`` for unusable input before any work (``SynthesisRequest.validate``,
        then the text frontend), and ``BusyError`` when the admission limits are reached.
        """
        request.validate(self.text.max_chars)  # cheap rules first, before the text is prepared
        sentences, prompt = await self.text_workers.prepare(request.text, request.voice)
        seed = secrets.randbits(63) if request.seed is None else request.seed
        await self.start()
        async with self.admission.slot(request.client):
            record = self.metrics.begin(request.request_id)
            status = "failed"
            try:
                for index, sentence in enumerate(sentences):
                    audio = await self._sentence(request, prompt, sentence.ids, index, seed, record)
                    # The one place a sentence ends early: closing its audio ends its token2wav
                    # stream, which drops its queued work and closes (aborts) its LM request.
                    async with contextlib.aclosing(audio):
                        async for samples in audio:
                            self.metrics.audio(record, len(samples) / self.sample_rate)
                            yield AudioChunk(samples, self.sample_rate, index)
                status = "done"
            except (asyncio.CancelledError, GeneratorExit):
                status = "cancelled"
                raise
            finally:
                self.metrics.end(record, status)

    async def synthesize(self, request: SynthesisRequest) -> tuple[int, np.ndarray]:
        """The whole clip of ``request``: (sample rate, float32 samples)."""
        pieces = [chunk.samples async for chunk in self.stream(request)]
        return self.sample_rate, np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    async def synthesize_batch(
        self, requests: list[SynthesisRequest]
    ) -> list[tuple[int, np.ndarray] | Exception]:
        """Whole clips of many requests at once (their work shares the engines' batches).

        Each entry is that request's clip or the exception that ended it; one failure never affects
        the others.
        """
        return await asyncio.gather(*(self.synthesize(r) for r in requests), return_exceptions=True)

    async def _sentence(
        self,
        request: SynthesisRequest,
        prompt: PromptInputs,
        ids: tuple[int, ...],
        index: int,
        seed: int,
        record: RequestRecord,
    ) -> AsyncGenerator[np.ndarray, None]:
        """The audio of one sentence: its LM request's tokens through a token2wav stream."""
        min_tokens, max_tokens = self.model.lm.sampling.length_limits(len(ids))
        lm_request = LMRequest(
            request_id=f"{request.request_id}-{index}",
            prompt_embeds=await asyncio.to_thread(self._prompt_embeds, prompt, ids),
            min_tokens=min_tokens,
            max_tokens=max_tokens,
            seed=sentence_seed(seed, index),
        )
        stream = self.token2wav.open_stream(
            prompt, speed=request.speed, streaming=request.streaming, seed=sentence_seed(seed, index)
        )
        return stream.run(self.lm.generate(lm_request), functools.partial(self.metrics.tokens, record))

    def _prompt_embeds(self, prompt: PromptInputs, ids: tuple[int, ...]) -> torch.Tensor:
        """The LM's prompt embeddings (L0, D) float32 on the CPU; runs in a worker thread."""
        with torch.inference_mode():
            embeds = self.model.lm.prompt_embeds(
                prompt.text_ids, torch.tensor(ids, dtype=torch.long), prompt.speech_tokens
            )
            return embeds.float().cpu()


def _gpu_memory_gb() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
