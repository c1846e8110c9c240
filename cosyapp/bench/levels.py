"""One level of load: ``clients`` requests at once through a driver, measured on both sides.

The client side (latency, throughput, underruns) comes from the driver's results; the engine side
(batch sizes, stage times, GPU memory) from the Pipeline's counters, when the Pipeline serving the
requests is in this process.
"""

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from cosyapp.bench.load import TextSet
from cosyapp.bench.resources import ResourceSampler
from cosyapp.bench.stats import (
    BatchSampler,
    RequestResult,
    engine_counters,
    gpu_memory,
    reset_gpu_peak,
    stage_times,
    summarize,
)
from cosyapp.bench.timeline import Timeline
from cosyapp.engine.pipeline import Pipeline

FIRST_SEED = 1000  # request i of every level uses seed FIRST_SEED + i
# What only an in-process Pipeline can tell (None for an external server).
ENGINE_FIELDS = (
    "batch_samples",
    "batch_hist",
    "lm_max_batch",
    "flow_max_batch",
    "hift_max_batch",
    "stage_last_s",
    "stages",
    "gpu_peak_allocated_gb",
    "gpu_device_used_gb",
    "gpu_allocator",
    "worker",
    "resources",
)


class Driver(Protocol):
    """What every driver in drivers.py offers."""

    name: str

    async def prepare(self, clients: int) -> None:
        """Set up what ``clients`` concurrent requests need (not timed)."""

    async def send(
        self, text: str, streaming: bool, seeds: list[int], on_done: Callable[[], None]
    ) -> list[RequestResult]:
        """One request per seed, all at once; ``on_done`` is called as each ends."""

    async def close(self) -> None:
        """Release connections and threads."""


async def measure(
    driver: Driver,
    text: TextSet,
    streaming: bool,
    clients: int,
    pipeline: Pipeline | None,
    on_done: Callable[[], None] = lambda: None,
    timeline: Timeline | None = None,
) -> dict:
    """Send ``clients`` requests of ``text`` at once; returns the level's summary.

    ``pipeline``: the Pipeline that serves the requests, when it runs in this process (its batch-size
    histograms, stage times and GPU memory are added); None for an external server. ``timeline``: a
    window of the level's GPU trace to record, summed up as its ``timeline`` (timeline.py).
    """
    await driver.prepare(clients)
    seeds = [FIRST_SEED + i for i in range(clients)]
    level = {"driver": driver.name, "text": text.name, "streaming": streaming, "clients": clients}
    if pipeline is None:
        start = time.perf_counter()
        results = await driver.send(text.text, streaming, seeds, on_done)
        return level | summarize(results, time.perf_counter() - start) | dict.fromkeys(ENGINE_FIELDS)
    sampler = BatchSampler(pipeline)
    resources = ResourceSampler()
    before = engine_counters(pipeline)
    reset_gpu_peak()
    sampler.start()
    resources.start()
    if timeline is not None:
        timeline.start()
    start = time.perf_counter()
    try:
        results = await driver.send(text.text, streaming, seeds, on_done)
    finally:
        wall = time.perf_counter() - start
        await sampler.stop()  # first: its last poll dates what progressed since the one before
        used = resources.stop()
        if timeline is not None:
            await asyncio.to_thread(timeline.finish)  # a window longer than the level ends here
    stages = {"stages": stage_times(before, engine_counters(pipeline), wall)}
    engine = sampler.report() | stages | gpu_memory() | _worker(pipeline) | used
    traced = {"timeline": timeline.summary()} if timeline is not None else {}
    return level | summarize(results, wall) | engine | traced


def _worker(pipeline: Pipeline) -> dict:
    """The options of the token2wav worker and the text lanes that served the level (a --variant swaps
    them)."""
    t2w = pipeline.token2wav
    return {
        "worker": {
            "first_hop": t2w.first_hop,
            "max_batch": t2w.max_batch,
            "overlap_hift": t2w.overlap_hift,
            "stream_priority": t2w.stream_priority,
            "hift_first": t2w.hift_first,
            "gather_ms": 1000 * t2w.gather_s,
            "expect_ms": 1000 * t2w.expect_s,
            "fill_ms": 1000 * t2w.fill_s,
            "step_frames": t2w.step_frames,
            "whole_step_frames": t2w.whole_step_frames or t2w.step_frames,
            "late_step_frames": t2w.late_step_frames or t2w.step_frames,
            "max_batch_per_call": t2w.max_batch_per_call,
            "flow_cache": t2w.cached is not None,
            "flow_cache_pages": t2w.cached.pool.pages if t2w.cached is not None else 0,
            "flow_cache_inputs": t2w.cached is not None and t2w.cached.pool.inputs,
            "flow_dtype": str(t2w.autocast_dtype) if t2w.autocast_dtype else None,
            "text_lanes": pipeline.text_workers.lanes,
        }
    }
