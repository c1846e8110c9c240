"""The worker's HiFT stage (worker.py): each step's jobs, per stream in order, through HiFT batched by
equal mel length, then each stream's cross-fade and delivery. It runs on the HiFT thread (or, without
overlap_hift, on the flow thread after each flow step)."""

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from cosyapp.engine.token2wav.hift_graphs import HiFTRunner
from cosyapp.engine.token2wav.jobs import failing, retry_in_halves, rounds
from cosyapp.engine.token2wav.stats import Token2WavStats
from cosyapp.engine.token2wav.stream import Job, stamp

# Mel frames in one HiFT call at most (batch x length). HiFT's activations grow with its output
# samples (480 per frame), so 64 whole 13 s clips in one call would need several GB on top of the
# flow's pool; 16,000 frames keeps a call within what served calls already reach (23 whole 260-token
# clips at 256 whole clips, 64 chunks of 108 frames at 64 streams) at any step size
# (ServeOptions.step_frames_per_row).
HIFT_FRAMES = 16_000


@dataclass
class Vocoding:
    """HiFT for the worker's steps: its runner (eager or graphs), the worker's counters, the rate, and
    the most mel frames one call may take (a longer group runs in several calls)."""

    hift_runner: HiFTRunner
    stats: Token2WavStats
    sample_rate: int
    max_frames: int = HIFT_FRAMES

    def step(self, jobs: list[Job]) -> None:
        """One flow step's jobs, a round of at most one job per stream at a time."""
        for jobs_round in rounds(jobs):
            # A failed job ends its stream, and a consumer may leave meanwhile: skip those.
            self._vocode([job for job in jobs_round if job.stream.live])

    def _vocode(self, jobs: list[Job]) -> None:
        """HiFT for at most one job per stream, batching jobs whose HiFT inputs have equal length, at
        most ``max_frames`` mel frames a call.

        HiFT's convolutions are not causal (they look both ways, and the iSTFT overlaps), so padding a
        shorter mel would change the end of its audio: only equal lengths share a call, the rest run
        in their own groups.
        """
        groups: dict[tuple[int, bool], list[tuple[Job, Tensor]]] = {}
        for job in jobs:
            with failing([job], "speed change"):
                mel = job.stream.hift_input(job)
                has_cache = job.stream.overlap.source is not None
                groups.setdefault((mel.shape[1], has_cache), []).append((job, mel))
        for group in groups.values():
            calls = -(-len(group) // max(1, self.max_frames // group[0][1].shape[1]))
            size = -(-len(group) // calls)  # even calls: 64 clips of 520 frames go as 22 + 21 + 21
            for start in range(0, len(group), size):
                part = group[start : start + size]
                retry_in_halves(part, self._vocode_group, lambda batch: [job for job, _ in batch], "HiFT")

    def _vocode_group(self, group: list[tuple[Job, Tensor]]) -> None:
        """One HiFT call for the group, then each job's cross-fade and delivery.

        Raises what the HiFT call raised, with every stream's noise generator as it was before it.
        """
        generators = [job.stream.generator for job, _ in group]
        noise_states = [g.get_state() for g in generators]
        jobs = [job for job, _ in group]
        started, cpu = stamp(jobs, "hift_start"), time.thread_time()
        try:
            speech, source = self._hift(group)
            # Every kernel is launched: the wait for the device and the copy to the CPU follow, so the
            # two stamps split the host's share of the call (eager launches that share the interpreter
            # lock with the flow thread and the event loop) from the device's.
            self.stats.hift_launch_cpu_seconds += time.thread_time() - cpu
            self.stats.hift_launch_seconds += stamp(jobs, "hift_launched") - started
            speech = speech.cpu()  # the device work is done past here
        except Exception:
            for generator, state in zip(generators, noise_states, strict=True):
                generator.set_state(state)  # a retry then draws the same noise as a first try
            raise
        self.stats.hift_calls += 1
        self.stats.hift_seconds += stamp(jobs, "hift_end") - started
        for i, (job, mel) in enumerate(group):
            with failing([job], "cross-fade"):
                audio = job.stream.overlap.finish(mel, speech[i], source[i], final=job.finalize)
                self.stats.jobs_done += 1
                job.stream.delivered(len(audio) / self.sample_rate)
                job.resolve(audio=audio.numpy().copy())

    def _hift(self, group: list[tuple[Job, Tensor]]) -> tuple[Tensor, Tensor]:
        """One HiFT call on equal-length mels, launched: (speech (B, L), source (B, 1, L)) on its device."""
        streams = [job.stream for job, _ in group]
        caches = [stream.overlap.source for stream in streams]
        speech, source = self.hift_runner(
            torch.stack([mel for _, mel in group]),
            None if caches[0] is None else torch.stack(caches),
            [stream.generator for stream in streams],
        )
        self.stats.last_hift_batch = len(group)
        self.stats.max_hift_batch = max(self.stats.max_hift_batch, len(group))
        return speech, source
