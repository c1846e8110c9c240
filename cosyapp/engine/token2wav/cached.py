"""The worker's side of the incremental streaming flow (flow_cache.py): which streams hold pages,
the voices' shared prompt pages, and the fall back to the recompute path.

A streaming stream takes the incremental path from its first chunk when the pool can give it
pages; it keeps them until its final chunk or until it ends otherwise, and a stream the pool cannot
serve at some chunk gives its pages back and finishes on the recompute path, which computes the same
frames. Whole clips (full attention over the whole sentence) always take the recompute path. Only
the worker's flow thread uses this object, besides the thread that captures missed graph buckets
(capturing.py).
"""

import logging

import torch

from cosyapp.engine.token2wav.flow_cache import FlowItem, IncrementalFlow, raw_estimator
from cosyapp.engine.token2wav.pages import FlowCache, KVPool, VoiceEntry, VoicePages, voice_frames, voice_key
from cosyapp.engine.token2wav.stream import Job, Stream
from cosyapp.models.cosyvoice2 import TOKEN_MEL_RATIO, CosyVoice2

logger = logging.getLogger(__name__)
VOICE_SHARE = 4  # at most 1/4 of the pool holds voices' prompt pages
# Of the GPU memory free once the LM engine has started, what the incremental flow's pages take by
# default; the rest is for flow and HiFT activations and the CUDA graphs (measured on an H200 with
# vLLM at 0.3: a 70 GB pool beside 64 streams).
FLOW_CACHE_SHARE = 0.7


class CachedFlow:
    """Incremental flow calls for the chunks of streams that hold pages.

    chunked_final: compute a stream's last chunk incrementally with the streaming masks too; False
    (default) computes it as upstream does, with full attention over the whole sentence (a
    recompute), after which the stream's pages are given back (docs/model.md §8.7). inputs: the pool
    keeps attention inputs instead of keys and values (pages.py). step_graphs: with graphs, a bucket's
    graph is one Euler step (incremental_graphs.py).
    """

    def __init__(
        self,
        model: CosyVoice2,
        pool_bytes: int,
        dtype: torch.dtype,
        graphs: bool,
        chunked_final: bool,
        inputs: bool = False,
        step_graphs: bool = False,
    ):
        est = raw_estimator(model.flow)
        steps = model.flow.decoder.n_timesteps
        pages = pool_bytes // KVPool.page_bytes(est, steps, dtype, inputs)
        self.model = model
        self.pool = KVPool(est, pages, steps, model.device, dtype, inputs)
        self.flow = IncrementalFlow(model.flow, self.pool, graphs=graphs, step_graphs=step_graphs)
        self.voices = VoicePages(self.pool, max_pages=pages // VOICE_SHARE)
        self.chunked_final = chunked_final
        self.holders: set[Stream] = set()
        self.fallbacks = 0  # streams and chunk calls the pool could not serve
        self.frames = 0  # mel frames handed to jobs
        kept = "attention inputs" if inputs else "keys and values"
        logger.info("incremental streaming flow: %d pages of %d frames (%s)", pages, self.pool.page, kept)

    @classmethod
    def sized(
        cls,
        model: CosyVoice2,
        size: int | None,
        dtype: torch.dtype,
        graphs: bool,
        chunked_final: bool,
        inputs: bool,
        step_graphs: bool = False,
    ) -> "CachedFlow | None":
        """The worker's incremental flow over a pool of ``size`` bytes; None = FLOW_CACHE_SHARE of the
        GPU memory free now (the worker starts after the LM engine holds its share; off on a CPU).
        None when that comes to nothing: every chunk then recomputes its prefix."""
        dev = model.device
        if size is None:
            size = int(FLOW_CACHE_SHARE * torch.cuda.mem_get_info(dev)[0]) if dev.type == "cuda" else 0
        return cls(model, size, dtype, graphs, chunked_final, inputs, step_graphs) if size else None

    def counters(self) -> dict:
        """The pool's and the graphs' counters as Token2WavStats fields."""
        pool = {
            "flow_cache_fallbacks": self.fallbacks,
            "flow_cache_pages": self.pool.pages,
            "flow_cache_free_pages": self.pool.free_pages,
            "flow_cache_least_free": self.pool.least_free,
            "incremental_frames": self.frames,
            "incremental_run_frames": self.flow.run_frames,
        }
        graphs = self.flow.graphs
        if graphs is None:
            return pool
        return pool | {
            "eager_flow_calls": graphs.eager_calls,
            "graph_captures": graphs.captures,
            "graph_capture_seconds": graphs.capture_seconds,
        }

    def free(self) -> None:
        """Give the pool's and the graphs' GPU memory back now, whatever still refers to this object (a
        worker swapped for another in one process: the bench's variants); the worker has stopped its
        capture thread first."""
        if self.flow.graphs is not None:
            self.flow.graphs.free()
        self.pool.free()

    def serves(self, job: Job) -> bool:
        """Whether ``job`` would go the incremental way, as far as is known before ``takes``."""
        stream = job.stream
        if not stream.streaming or stream.flow_cache_refused:
            return False
        if job.finalize and not self.chunked_final:
            return False  # upstream's full-attention last chunk: a recompute (the worker releases)
        return stream.flow_cache is not None or job.offset == 0

    def takes(self, job: Job) -> bool:
        """Whether ``job`` goes the incremental way (the stream's cache is made at its first chunk)."""
        stream = job.stream
        if not self.serves(job):
            return False
        if stream.flow_cache is None:
            stream.flow_cache = self._start(stream)
            stream.flow_cache_refused = stream.flow_cache is None
        return stream.flow_cache is not None

    def run(self, jobs: list[Job]) -> list[Job]:
        """Set job.mel for ``jobs`` (at most one per stream, all final or all not); returns the jobs
        the pool could not serve, their streams moved to the recompute path."""
        items = [self._item(job) for job in jobs]
        results = self.flow(items)
        if results is None:
            self.fallbacks += 1
            for job in jobs:
                self.release(job.stream)
                job.stream.flow_cache_refused = True
            return jobs
        for job, (mel, start) in zip(jobs, results, strict=True):
            prompt_frames = len(job.stream.device_prompt.speech_feat)
            job.mel = mel[:, prompt_frames + TOKEN_MEL_RATIO * job.offset - start :]
            self.frames += job.mel.shape[1]
            if job.finalize:
                self.release(job.stream)
        return []

    def release(self, stream: Stream) -> None:
        """Give back the pages of ``stream`` (idempotent)."""
        if stream.flow_cache is not None:
            self.pool.release(stream.flow_cache.pages)
            stream.flow_cache = None
        self.holders.discard(stream)

    def sweep(self) -> None:
        """Give back the pages of streams that ended without their final chunk (cancelled, failed)."""
        for stream in [s for s in self.holders if not s.live]:
            self.release(stream)

    def _item(self, job: Job) -> FlowItem:
        prompt = job.stream.device_prompt
        tokens = job.tokens.to(self.model.device)
        return FlowItem(
            job.stream.flow_cache,
            prompt.speech_tokens,
            prompt.speech_feat,
            prompt.embedding,
            tokens,
            job.finalize,
        )

    def _start(self, stream: Stream) -> FlowCache | None:
        """A cache for ``stream``: from its voice's prompt pages (computed now if new), or empty."""
        prompt = stream.device_prompt
        frames = voice_frames(
            len(prompt.speech_tokens), self.pool.page // TOKEN_MEL_RATIO, 3, TOKEN_MEL_RATIO
        )
        cache = FlowCache()
        if frames:
            key = voice_key(stream.prompt.speech_tokens, stream.prompt.speech_feat, stream.prompt.embedding)
            entry = self.voices.get(key)
            if entry is None:
                entry = self._voice_entry(stream, frames)
                if entry is None:
                    self.fallbacks += 1
                    return None
                self.pool.retain(entry.pages)
                self.voices.put(key, entry)  # takes over the prompt pass's reference
            else:
                self.pool.retain(entry.pages)
            cache = FlowCache(list(entry.pages), entry.tails.clone(), entry.frames)
        self.holders.add(stream)
        return cache

    def _voice_entry(self, stream: Stream, frames: int) -> VoiceEntry | None:
        """The voice's prompt pages, computed now (one reference, the caller's), or None."""
        prompt = stream.device_prompt
        seed = FlowCache()
        no_tokens = prompt.speech_tokens[:0]
        item = FlowItem(
            seed, prompt.speech_tokens, prompt.speech_feat, prompt.embedding, no_tokens, False, frames
        )
        if self.flow([item]) is None:
            return None
        return VoiceEntry(seed.pages, seed.tails, seed.frames)
