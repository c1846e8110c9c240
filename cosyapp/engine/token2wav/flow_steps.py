"""The token2wav worker's flow stage (worker.py): one step's jobs through the incremental flow, for
streams holding pages, and one padded recompute call per (streaming, finalize) mode for the rest.
Runs on the worker's flow thread; each job's mel is set for the HiFT stage (vocoding.py)."""

import contextlib
import functools
import time

import torch

from cosyapp.engine.cuda_streams import role_stream
from cosyapp.engine.token2wav.cached import CachedFlow
from cosyapp.engine.token2wav.jobs import failing, recompute, retry_in_halves, rounds
from cosyapp.engine.token2wav.stats import Token2WavStats
from cosyapp.engine.token2wav.stream import Job, stamp
from cosyapp.models.cosyvoice2 import TOKEN_MEL_RATIO, CosyVoice2


class FlowSteps:
    """The flow of the worker's steps. ``cached`` is the incremental flow (None: every job recomputes
    its prefix, as upstream); the worker gives it its pool at start. flow_overlap and stream_priority:
    as Token2Wav's. max_rows: the most jobs of one recompute call (None: a mode's every job), for
    steps whose bound is per call (scheduler.py ``max_batch_per_call``), where incremental jobs the
    pool refuses join the recompute calls."""

    def __init__(
        self,
        model: CosyVoice2,
        autocast_dtype: torch.dtype | None,
        stats: Token2WavStats,
        flow_overlap: bool = False,
        stream_priority: int = 0,
        max_rows: int | None = None,
    ):
        self.model, self.autocast_dtype, self.stats = model, autocast_dtype, stats
        self.max_rows = max_rows
        self.flow_overlap, self.stream_priority = flow_overlap, stream_priority
        self.cached: CachedFlow | None = None

    def cost(self, job: Job) -> tuple[tuple, int]:
        """The flow call a job joins and the frames it pads that call to: its new frames in the
        incremental flow, prompt + every token when recomputed (scheduler.py)."""
        stream = job.stream
        incremental = self.cached is not None and self.cached.serves(job)
        if incremental:
            return ("incremental", job.finalize), TOKEN_MEL_RATIO * (len(job.tokens) - job.offset)
        return ("recompute", job.streaming, job.finalize), TOKEN_MEL_RATIO * (
            len(stream.prompt.speech_tokens) + len(job.tokens)
        )

    def run(self, jobs: list[Job]) -> None:
        """Set job.mel for every job: the incremental flow for streams holding pages, then one padded
        recompute call per (streaming, finalize) mode for the rest. With flow_overlap the incremental
        calls run on a CUDA stream of their own, unwaited, while this thread launches the recompute
        calls (a step at 128-256 streams holds both, each too small to fill the GPU alone), and the
        step ends once both are done: their mels are complete before HiFT reads them."""
        if self.cached is None:
            self._recompute(jobs)
            return
        if not self.flow_overlap:
            self._recompute(self._incremental(jobs))
            return
        beside = self._beside()
        with torch.cuda.stream(beside) if beside is not None else contextlib.nullcontext():
            rest = self._incremental(jobs, sync=False)
        self._recompute(rest)
        taken = [job for job in jobs if job not in rest]
        if taken:
            self.stats.overlapped_steps += bool(rest)
            started = time.monotonic()
            if beside is not None:
                with failing(taken, "flow"):  # an error of the unwaited calls surfaces here
                    beside.synchronize()
            self.stats.flow_seconds += stamp(taken, "flow_end") - started

    def _beside(self) -> "torch.cuda.Stream | None":
        """The incremental calls' CUDA stream (flow_overlap), after this thread's work so far; None
        off CUDA."""
        dev = self.model.device
        if dev.type != "cuda":
            return None
        beside = role_stream("flow-beside", dev, self.stream_priority)
        beside.wait_stream(torch.cuda.current_stream(dev))
        return beside

    def _recompute(self, jobs: list[Job]) -> None:
        """One padded recompute call per (streaming, finalize) mode and ``max_rows`` jobs, each waited
        for (``_timed``)."""
        self.stats.recompute_jobs += len(jobs)
        groups: dict[tuple[bool, bool], list[Job]] = {}
        for job in jobs:
            groups.setdefault((job.streaming, job.finalize), []).append(job)
        for (streaming, finalize), group in groups.items():
            flow = functools.partial(self._flow_batch, streaming=streaming, finalize=finalize)
            size = self.max_rows or len(group)
            for start in range(0, len(group), size):
                retry_in_halves(group[start : start + size], flow, lambda batch: batch, "flow")

    def _incremental(self, jobs: list[Job], sync: bool = True) -> list[Job]:
        """Run the jobs the incremental flow takes, a round of at most one job per stream at a time
        (a stream's next chunk starts from this one's pages); returns the jobs left to recompute.
        sync False: launched, not waited for (flow_overlap; the rounds follow each other on the
        stream)."""
        cached = self.cached
        assert cached is not None
        cached.sweep()
        dev = self.model.device
        with torch.autocast(dev.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            taken = []
            for job in jobs:
                with failing([job], "flow cache"):
                    if cached.takes(job):
                        taken.append(job)
            rest = [job for job in jobs if job not in taken and job.stream.live]

            def run(batch: list[Job]) -> None:
                refused = self._timed(cached.run, batch, sync)
                self.stats.incremental_jobs += len(batch) - len(refused)
                rest.extend(refused)

            for jobs_round in rounds(taken):
                for final in (False, True):
                    group = [j for j in jobs_round if j.finalize == final and j.stream.live]
                    # A stream the pool could not serve at an earlier round recomputes from then on.
                    rest.extend(j for j in group if j.stream.flow_cache is None)
                    group = [j for j in group if j.stream.flow_cache is not None]
                    if group:
                        retry_in_halves(group, run, lambda b: b, "flow")
        for job in rest:
            if job.finalize:
                cached.release(job.stream)  # its last chunk is a full recompute: no pages needed
        return rest

    def _timed(self, run, jobs: list[Job], sync: bool = True):
        """``run(jobs)``, one flow call, counted in the stats and stamped on its jobs (sync False:
        its launch only; ``_flow`` waits for it and stamps its end)."""
        started = stamp(jobs, "flow_start")
        result = run(jobs)
        if sync and self.model.device.type == "cuda":
            # This thread's CUDA stream only (count its device time, not just the launches); a
            # device-wide synchronise would also wait for the HiFT thread's work.
            torch.cuda.current_stream(self.model.device).synchronize()
        self.stats.flow_calls += 1
        self.stats.flow_seconds += stamp(jobs, "flow_end") - started
        self.stats.last_flow_batch = len(jobs)
        self.stats.max_flow_batch = max(self.stats.max_flow_batch, len(jobs))
        return result

    def _flow_batch(self, jobs: list[Job], streaming: bool, finalize: bool) -> None:
        """One flow call for ``jobs`` (all of one mode), setting each job's mel; raises what it raised."""
        mode = {"streaming": streaming, "finalize": finalize, "stats": self.stats}
        call = functools.partial(recompute, self.model, self.autocast_dtype, **mode)
        mels = self._timed(call, jobs)
        for job, mel in zip(jobs, mels, strict=True):
            job.mel = mel
