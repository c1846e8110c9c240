"""The Pipeline: one per process, shared by every session, from a request to streamed audio.

    request -> text frontend (sentences, ids) -> per sentence: prompt embeddings -> LM engine
    (batched across all requests) -> token2wav worker (batched across all streams) -> audio chunks

Every CosyVoice 2 mode takes this path (``frontend/modes.py``): the LM requests of zero-shot,
cross-lingual and instruct2 differ only in their prompt, and voice conversion feeds the source
speech's tokens to token2wav instead of an LM request's.

Each request has an audio budget (``budget.AudioBudget``; the server's from its options through
``build.build_pipeline``, none by default): a sentence that reaches its limit is cut
and the request goes on; a request that reaches its own ends. Either way the stream then yields an
empty ``AudioChunk`` whose ``note`` says so, and the request ends cleanly.

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
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from cosyapp.engine.admission import BusyError as BusyError  # callers take it with the Pipeline
from cosyapp.engine.admission import FairAdmission
from cosyapp.engine.budget import NO_BUDGET, AudioBudget, RequestBudget
from cosyapp.engine.lm.base import LMRequest, SpeechTokenLM
from cosyapp.engine.metrics import Metrics, RequestRecord
from cosyapp.engine.request import MAX_SEED, SynthesisRequest
from cosyapp.engine.request import MAX_SPEED as MAX_SPEED  # the limits, for callers of the Pipeline
from cosyapp.engine.request import MIN_SPEED as MIN_SPEED
from cosyapp.engine.text_workers import TextWorkers
from cosyapp.engine.token2wav.compiling import COMPILER
from cosyapp.engine.token2wav.flow_cache import BATCH_BUCKETS
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.frontend.modes import INSTRUCT, VOICE_CONVERSION, instruction_prompt, lm_prompt
from cosyapp.frontend.text import Sentence, TextFrontend
from cosyapp.models.cosyvoice2 import CosyVoice2, PromptInputs
from cosyapp.options import DEFAULTS


@dataclass(frozen=True)
class AudioChunk:
    """Consecutive float32 samples (N,) at ``sample_rate``; ``sentence`` is the sentence index.

    ``note`` is set, on a chunk of no samples, when a sentence or the request reached its audio
    budget: what was cut, in words for the user. ``times``, on a sentence's first chunk: when it
    passed each stage on its way (the request's text ready and its admission, then
    ``Stream.first_chunk_times``), for the benchmark's TTFA breakdown."""

    samples: np.ndarray
    sample_rate: int
    sentence: int
    note: str | None = None
    times: dict[str, float] | None = None


def sentence_seed(seed: int, index: int) -> int:
    """A per-sentence seed derived from the request seed (independent streams per sentence)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_SEED


class ServingFront:
    """What the web layer calls, the same on a Pipeline and on the cluster ingress
    (cosyapp/cluster/ingress.py): each has its own ``stream`` and ``admission``; the whole clips and
    the admission's limits are defined here once."""

    sample_rate: int
    admission: FairAdmission

    @property
    def max_streams(self) -> int:
        return self.admission.max_streams

    @property
    def max_waiting(self) -> int:
        return self.admission.max_waiting

    def stream(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        raise NotImplementedError

    async def synthesize(self, request: SynthesisRequest) -> tuple[int, np.ndarray]:
        """The whole clip of ``request``: (sample rate, float32 samples)."""
        pieces = [chunk.samples async for chunk in self.stream(request)]
        return self.sample_rate, np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    async def synthesize_batch(
        self, requests: list[SynthesisRequest]
    ) -> list[tuple[int, np.ndarray] | Exception]:
        """Whole clips of many requests at once (their work shares the engines' batches; in a cluster
        they spread over the replicas).

        Each entry is that request's clip or the exception that ended it; one failure never affects
        the others.
        """
        return await asyncio.gather(*(self.synthesize(r) for r in requests), return_exceptions=True)


class Pipeline(ServingFront):
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
        budget: AudioBudget = NO_BUDGET,
        text_lanes: int = DEFAULTS.text_lanes,
    ):
        self.model = model
        self.text = text
        self.text_workers = TextWorkers(text, text_lanes)
        self.lm = lm
        self.token2wav = token2wav
        self.metrics = metrics or Metrics()
        self.budget = budget
        self.admission = FairAdmission(max_streams, max_waiting, on_reject=self.metrics.rejected)
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self.startup_s: dict[str, float] = {}  # seconds each phase of start() took, in order
        self.metrics.gauges.update(
            queue_depth=lambda: self.admission.waiting,
            lm_batch_size=lambda: self.lm.stats().last_batch_size,
            lm_max_batch_size=lambda: self.lm.stats().max_batch_size,
            token2wav_batch_size=lambda: self.token2wav.stats().last_flow_batch,
            token2wav_max_batch_size=lambda: self.token2wav.stats().max_flow_batch,
            # The incremental flow's pool (0 without one) and its chunk jobs by path: a stream the
            # pool cannot hold recomputes its prefix for each later chunk.
            flow_cache_pages=lambda: self.token2wav.stats().flow_cache_pages,
            flow_cache_free_pages=lambda: self.token2wav.stats().flow_cache_free_pages,
            flow_cache_fallbacks=lambda: self.token2wav.stats().flow_cache_fallbacks,
            flow_incremental_jobs=lambda: self.token2wav.stats().incremental_jobs,
            flow_recompute_jobs=lambda: self.token2wav.stats().recompute_jobs,
            gpu_memory_gb=_gpu_memory_gb,
        )

    @property
    def sample_rate(self) -> int:
        return self.model.sample_rate

    @property
    def device(self) -> torch.device:
        return self.model.device

    async def start(self, warm_up: bool = False) -> None:
        """Start the engines on the running event loop (idempotent; the first request starts them too).

        ``warm_up`` also runs token2wav at every batch size it will see, so first requests do not pay
        for kernel selection and allocator growth. The vLLM engine stays bound to this loop.
        """
        self._start_lock = self._start_lock or asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            phases = self.startup_s
            with _timed(phases, "lm"):
                await self.lm.start()
            with _timed(phases, "text_workers"):
                await self.text_workers.start()
            # --compile-flow compiles once the start is done (COMPILER.held): serving starts eagerly.
            with COMPILER.held():
                with _timed(phases, "flow_graphs"):
                    await asyncio.to_thread(self.token2wav.capture_graphs)
                self.token2wav.start()
                self._started = True
                if warm_up:
                    with _timed(phases, "warm_up"):
                        await self.warm_up_token2wav()

    async def warm_up_token2wav(self) -> None:
        """Streaming token2wav for as many streams at once as each row bucket of the incremental flow
        (flow_cache.BATCH_BUCKETS) up to max_batch, and whole clips for 1, 2, 4, ... up to max_batch (in
        steps as large as the worker's step_frames allows). A 10.4 s sentence: streams go through
        first, middle (100-token) and final chunks, whose incremental graphs are captured here
        rather than during requests (between steps; this waits until they are)."""
        g = torch.Generator().manual_seed(0)
        prompt = PromptInputs(
            text_ids=torch.zeros(1, dtype=torch.long),
            speech_tokens=torch.randint(0, 6561, (75,), generator=g),
            speech_feat=torch.randn(150, 80, generator=g) - 5.0,
            embedding=torch.randn(192, generator=g),
        )
        tokens = torch.randint(0, 6561, (260,), generator=g).tolist()

        async def streamed() -> None:
            stream = self.token2wav.open_stream(prompt, streaming=True, seed=0)

            async def feed():
                # A token at a time once the chunks so far are done: each chunk's step has `batch`
                # rows. All at once, a step's max_batch jobs held a stream's 4 chunks: 1/4 the rows.
                for token in tokens:
                    pending = [future for future in stream.futures if not future.done()]
                    if pending:
                        await asyncio.wait(pending)
                    yield [token]

            async for _ in stream.run(feed()):
                pass

        for batch, whole in warm_up_batches(self.token2wav.max_batch):
            # Each group's first jobs reach the worker together, so every batch size is really run.
            await self.token2wav.together([streamed() for _ in range(batch)], batch)
            if whole:
                await self.token2wav.together(
                    [self.token2wav.whole_clip(prompt, tokens, seed=0) for _ in range(batch)], batch
                )
        await self.token2wav.graphs_settled()

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
        then the text frontend's first block), and ``BusyError`` when the admission limits are
        reached. Sentences after the first block are prepared while the first ones are spoken.
        """
        request.validate(self.text.max_chars)  # cheap rules first, before the text is prepared
        sentences, prompt, seen = await self._prepare(request)
        stamps = {"prepared": time.monotonic()}  # the request's way to its first chunk (AudioChunk.times)
        seed = secrets.randbits(63) if request.seed is None else request.seed
        budget = self.budget.request()
        async with contextlib.aclosing(sentences):
            await self.start()
            async with self.admission.slot(request.client):
                stamps["admitted"] = time.monotonic()
                record = self.metrics.begin(request.request_id, request.mode)
                status = "failed"
                try:
                    index = 0
                    async for sentence in sentences:
                        async for chunk in self._sentence_audio(
                            request, prompt, seen, sentence, index, seed, record, budget, stamps
                        ):
                            yield chunk
                        if budget.left <= 0:
                            break
                        index += 1
                    status = "done"
                except (asyncio.CancelledError, GeneratorExit):
                    status = "cancelled"
                    raise
                finally:
                    self.metrics.end(record, status)

    async def _prepare(
        self, request: SynthesisRequest
    ) -> tuple[AsyncGenerator[Sentence, None], PromptInputs, PromptInputs | None]:
        """The request's sentences, its voice's prompt (the flow's) and what the LM sees of it in the
        request's mode (``modes.lm_prompt``; None: voice conversion, no LM), prepared off the loop.
        Voice conversion has one sentence, of no text: the speech to convert."""
        if request.mode == VOICE_CONVERSION:
            return _given([Sentence("", ())]), request.voice.features.prompt([]), None
        instruction = ()
        if request.mode == INSTRUCT:
            instruction = await self.text_workers.tokenize(instruction_prompt(request.instruction))
        sentences, prompt = await self.text_workers.prepare(request.text, request.voice)
        return sentences, prompt, lm_prompt(request.mode, prompt, instruction)

    async def _sentence_audio(
        self,
        request: SynthesisRequest,
        prompt: PromptInputs,
        seen: PromptInputs | None,
        sentence: Sentence,
        index: int,
        seed: int,
        record: RequestRecord,
        budget: RequestBudget,
        stamps: dict[str, float],
    ) -> AsyncGenerator[AudioChunk, None]:
        """One sentence's chunks, then a note chunk if it reached its limit; spends the budget.
        ``stamps``: the request's times before its first sentence (added to the first chunk's).

        The LM request's tokens (at most the budget's cap, in the request and here), or in voice
        conversion (``seen`` None) the source's tokens, go through a token2wav stream in ``prompt``."""
        if seen is None:  # at most 30 s of source speech: no LM, nothing to cap
            tokens, max_tokens, note = _given([list(request.source_tokens)]), len(request.source_tokens), None
            counted = None
        else:
            min_tokens, upstream_max = self.model.lm.sampling.length_limits(len(sentence.ids))
            max_tokens, note = budget.cap(sentence.text, index, upstream_max)
            lm_request = LMRequest(
                request_id=f"{request.request_id}-{index}",
                prompt_embeds=await asyncio.to_thread(self._prompt_embeds, seen, sentence.ids),
                min_tokens=min(min_tokens, max_tokens),
                max_tokens=max_tokens,
                seed=sentence_seed(seed, index),
            )
            tokens, counted = self.lm.generate(lm_request), functools.partial(self.metrics.tokens, record)
        stream = self.token2wav.open_stream(
            prompt, speed=request.speed, streaming=request.streaming, seed=sentence_seed(seed, index)
        )
        cap = TokenCap(max_tokens)
        audio = stream.run(cap.cut(tokens), counted)
        # The one place a sentence ends early: closing its audio ends its token2wav stream, which
        # drops its queued work and closes (aborts) its LM request.
        async with contextlib.aclosing(audio):
            first = True
            async for samples in audio:
                self.metrics.audio(record, len(samples) / self.sample_rate)
                times, first = (stream.first_chunk_times() if first else None), False
                if times is not None:
                    times = {**stamps, **times}
                yield AudioChunk(samples, self.sample_rate, index, times=times)
        budget.spend(cap.made)
        if note is not None and cap.made >= max_tokens:
            yield AudioChunk(np.zeros(0, np.float32), self.sample_rate, index, note)

    def _prompt_embeds(self, prompt: PromptInputs, ids: tuple[int, ...]) -> torch.Tensor:
        """The LM's prompt embeddings (L0, D) float32 on the CPU, from what the LM sees of the
        voice (``modes.lm_prompt``); runs in a worker thread."""
        with torch.inference_mode():
            embeds = self.model.lm.prompt_embeds(
                prompt.text_ids, torch.tensor(ids, dtype=torch.long), prompt.speech_tokens
            )
            return embeds.float().cpu()


class TokenCap:
    """Cuts an LM's token lists at ``limit`` in all, so a budget holds whatever an engine does with
    ``max_tokens``; ``made`` counts the tokens let through."""

    def __init__(self, limit: int):
        self.limit = limit
        self.made = 0

    async def cut(self, tokens: AsyncGenerator[list[int], None]) -> AsyncGenerator[list[int], None]:
        """``tokens`` up to the limit; closing this closes (aborts) ``tokens``."""
        async with contextlib.aclosing(tokens):
            async for new in tokens:
                new = new[: self.limit - self.made]
                self.made += len(new)
                if new:
                    yield new
                if self.made >= self.limit:
                    return


async def _given(items: list) -> AsyncGenerator:
    """``items`` as an async iterator (what is already known, where the Pipeline reads a stream)."""
    for item in items:
        yield item


def _gpu_memory_gb() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Record in ``phases[name]`` how long the block took (seconds), also when it raises."""
    started = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = time.perf_counter() - started


def warm_up_batches(max_batch: int) -> list[tuple[int, bool]]:
    """(streams at once, whole clips too) for the warm-up: each row bucket of the incremental flow up to
    max_batch; whole clips at the powers of two only, which meet every bucket of their graphs."""
    return [(b, b & (b - 1) == 0) for b in BATCH_BUCKETS if b <= max_batch]
