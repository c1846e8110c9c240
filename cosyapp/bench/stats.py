"""What a level measures: per-request timings, their summary, and the engines' own statistics."""

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from cosyapp.engine.lm.base import LMStats
from cosyapp.engine.metrics import percentile
from cosyapp.engine.pipeline import Pipeline
from cosyapp.engine.token2wav.stats import Token2WavStats

STAGES = ("lm", "flow", "hift")
QUANTILES = (50, 90, 99)
# The first chunk's time to first audio, stage by stage: (stage, from stamp, to stamp) of
# Stream.first_chunk_times, with the request's start before them and its receipt after; the stages
# add up to the TTFA. text: the text and voice prepared (in a text lane: its thread, its wetext
# process); admission: waiting for a slot; lm_prompt: the LM's prompt embeddings (a worker thread),
# the LM request made; lm_first_tokens: prefill;
# lm_chunk_tokens: decoding the rest of the chunk's tokens; flow_queue / hift_queue: waiting for
# the worker's stage; hift_launch: HiFT's kernels launched (on a CPU, run); hift_wait: the device's
# work after the last launch, and the audio's copy to the CPU; delivery: back to the event loop and
# the client.
FIRST_CHUNK_STAGES = (
    ("text", "start", "prepared"),
    ("admission", "prepared", "admitted"),
    ("lm_prompt", "admitted", "run"),
    ("lm_first_tokens", "run", "first_tokens"),
    ("lm_chunk_tokens", "first_tokens", "submitted"),
    ("flow_queue", "submitted", "flow_start"),
    ("flow", "flow_start", "flow_end"),
    ("hift_queue", "flow_end", "hift_start"),
    ("hift_launch", "hift_start", "hift_launched"),
    ("hift_wait", "hift_launched", "hift_end"),
    ("delivery", "hift_end", "received"),
)


def first_chunk_stages(times: dict[str, float], start: float, received: float) -> dict[str, float]:
    """Seconds per FIRST_CHUNK_STAGES from a first chunk's stamps and the request's start and receipt
    (all time.monotonic)."""
    at = {**times, "start": start, "received": received}
    return {stage: at[end] - at[begin] for stage, begin, end in FIRST_CHUNK_STAGES}


@dataclass
class RequestResult:
    """One request as its client saw it. ``chunks``: (seconds after sending, audio seconds) of each
    piece of audio received, in order; ``total``: seconds until the response ended; ``player``: what
    the page's player measured (browser driver): ``click_to_sound_s``, ``first_chunk_s`` (the click
    to the first chunk in the page), ``server_ttfa_s``, ``underruns``."""

    chunks: list[tuple[float, float]] = field(default_factory=list)
    total: float | None = None
    error: str | None = None
    player: dict | None = None
    first_chunk: dict[str, float] | None = None  # seconds per FIRST_CHUNK_STAGES (in-process driver)

    @property
    def ttfa(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def audio_s(self) -> float:
        return sum(seconds for _, seconds in self.chunks)


def playback_stalls(chunks: list[tuple[float, float]]) -> list[tuple[int, float]]:
    """(index, stall seconds) of each chunk a player waited for: it starts at the first chunk and,
    whenever the next chunk arrives after the audio delivered so far has finished playing, waits."""
    stalls = []
    ends = None  # when the audio delivered so far finishes playing
    for index, (arrival, seconds) in enumerate(chunks):
        if ends is None:
            ends = arrival
        elif arrival > ends:
            stalls.append((index, arrival - ends))
            ends = arrival
        ends += seconds
    return stalls


def playback_underruns(chunks: list[tuple[float, float]]) -> tuple[int, float]:
    """(underrun events, stall seconds) of ``playback_stalls``."""
    stalls = playback_stalls(chunks)
    return len(stalls), sum(stall for _, stall in stalls)


def stalls_by_chunk(results: list[list[tuple[float, float]]]) -> dict[str, float]:
    """Stall seconds summed by the index of the late chunk (as the client received the pieces: the
    engine's chunks for the in-process driver), over every request's chunks."""
    by_index: dict[int, float] = {}
    for chunks in results:
        for index, stall in playback_stalls(chunks):
            by_index[index] = by_index.get(index, 0.0) + stall
    return {str(index): by_index[index] for index in sorted(by_index)}


def summarize(results: list[RequestResult], wall: float) -> dict:
    """Latency percentiles, throughput and playback underruns of a level's requests (failed requests
    are counted, and their distinct messages kept, but not measured)."""
    done = [r for r in results if r.error is None]
    ttfa = [r.ttfa for r in done if r.ttfa is not None]
    total = [r.total for r in done]
    rtf = [r.total / r.audio_s for r in done if r.audio_s]
    audio = sum(r.audio_s for r in done)
    underruns = [playback_underruns(r.chunks) for r in done]
    return {
        "requests": len(results),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error is not None}),
        "wall_s": wall,
        "audio_s": audio,
        **{f"ttfa_p{q}": percentile(ttfa, q / 100) for q in (50, 90, 99)},
        **{f"total_p{q}": percentile(total, q / 100) for q in (50, 90, 99)},
        "rtf_aggregate": wall / audio if audio else None,
        "rtf_p50": percentile(rtf, 0.5),
        "requests_per_s": len(done) / wall,
        "audio_per_wall_s": audio / wall,
        "underrun_events": sum(events for events, _ in underruns),
        "streams_with_underruns": sum(1 for events, _ in underruns if events),
        "stall_s_total": sum(stall for _, stall in underruns),
        "stall_s_by_chunk": stalls_by_chunk([r.chunks for r in done]),
        "first_chunk_p50": first_chunk_summary(done),
        **player_summary(done),
    }


def first_chunk_summary(results: list[RequestResult]) -> dict[str, float] | None:
    """The median seconds of each first-chunk stage; None where the driver saw no stages (HTTP)."""
    seen = [r.first_chunk for r in results if r.first_chunk is not None]
    if not seen:
        return None
    return {stage: percentile([s[stage] for s in seen], 0.5) for stage, _, _ in FIRST_CHUNK_STAGES}


def player_summary(results: list[RequestResult]) -> dict:
    """p50/p90/p99 of click-to-sound, the server's TTFA, their difference (``player_delay``: what the
    page, Gradio's queue and the network add) and its two parts: ``delivery`` (the first chunk's
    arrival in the page less the server's TTFA: the click reaching the handler and the chunk
    reaching the page) and ``sound_after_chunk`` (the player alone: arrival to the first sample at
    the output); and the player's underruns. Empty without player measurements."""
    players = [r.player for r in results if r.player is not None]
    if not players:
        return {}

    def differences(later: str, earlier: str) -> list[float]:
        return [p[later] - p[earlier] for p in players if p[later] is not None and p[earlier] is not None]

    series = {
        "click_to_sound": [p["click_to_sound_s"] for p in players if p["click_to_sound_s"] is not None],
        "server_ttfa": [p["server_ttfa_s"] for p in players if p["server_ttfa_s"] is not None],
        "player_delay": differences("click_to_sound_s", "server_ttfa_s"),
        "delivery": differences("first_chunk_s", "server_ttfa_s"),
        "sound_after_chunk": differences("click_to_sound_s", "first_chunk_s"),
    }
    return {
        **{f"{name}_p{q}": percentile(values, q / 100) for name, values in series.items() for q in QUANTILES},
        "player_underruns": sum(p["underruns"] for p in players),
        "pages_with_underruns": sum(1 for p in players if p["underruns"]),
    }


class BatchSampler:
    """Samples the engines' batch sizes every ``period`` seconds while a level runs.

    A poll adds a sample for a stage only when that engine progressed since the previous poll (a
    decode step, a flow call, a HiFT call), so idle time and an earlier level's last batch add none.
    Samples are not calls: a poll sees only the latest of the calls made since the previous one.
    It also notes when each stage last progressed, in seconds from ``start`` (``stage_last_s``): an
    LM that ended its decoding well before the level's end did not hold the level up; the stages
    after it did.
    """

    def __init__(self, pipeline: Pipeline, period: float = 0.002):
        self.pipeline = pipeline
        self.period = period
        self.samples: dict[str, list[int]] = {stage: [] for stage in STAGES}
        self._last = engine_counters(pipeline)
        self._task: asyncio.Task | None = None
        self._started = time.perf_counter()
        self.last_s: dict[str, float | None] = dict.fromkeys(STAGES)

    def start(self) -> None:
        self._started = time.perf_counter()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop polling; a last poll records what happened since the one before."""
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._poll()

    def report(self) -> dict:
        """Histograms {size: samples} per stage, sample counts and the largest size seen."""
        return {
            "batch_samples": {stage: len(sizes) for stage, sizes in self.samples.items()},
            "batch_hist": {
                stage: {str(size): n for size, n in sorted(Counter(sizes).items())}
                for stage, sizes in self.samples.items()
            },
            **{f"{stage}_max_batch": max(sizes, default=0) for stage, sizes in self.samples.items()},
            "stage_last_s": {
                stage: None if at is None else round(at, 3) for stage, at in self.last_s.items()
            },
        }

    def _poll(self) -> None:
        (lm0, t2w0), (lm, t2w) = self._last, engine_counters(self.pipeline)
        now = time.perf_counter() - self._started
        progressed = {
            "lm": lm.tokens_generated > lm0.tokens_generated,
            "flow": t2w.flow_calls > t2w0.flow_calls,
            "hift": t2w.hift_calls > t2w0.hift_calls,
        }
        self.last_s.update({stage: now for stage, moved in progressed.items() if moved})
        # A step cannot be larger than the requests running; this also drops a size left over from
        # before the level (a first token comes from a prefill, which reports no size, and vLLM
        # reports its scheduler's sizes with a delay).
        if progressed["lm"] and lm.running:
            self.samples["lm"].append(min(lm.last_batch_size, lm.running))
        if progressed["flow"]:
            self.samples["flow"].append(t2w.last_flow_batch)
        if progressed["hift"]:
            self.samples["hift"].append(t2w.last_hift_batch)
        self._last = (lm, t2w)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self._poll()


def engine_counters(pipeline: Pipeline) -> tuple[LMStats, Token2WavStats]:
    """The LM engine's and the token2wav worker's counters now."""
    return pipeline.lm.stats(), pipeline.token2wav.stats()


def stage_times(
    before: tuple[LMStats, Token2WavStats], after: tuple[LMStats, Token2WavStats], wall: float
) -> dict:
    """Work of each stage between two reads of the engines' counters.

    The token2wav worker times its flow and HiFT calls (device work included); the LM engines count
    tokens but do not time their steps, so the LM is given as tokens and tokens per second.
    """
    (lm0, t2w0), (lm1, t2w1) = before, after
    flow_calls, hift_calls = t2w1.flow_calls - t2w0.flow_calls, t2w1.hift_calls - t2w0.hift_calls
    flow_s, hift_s = t2w1.flow_seconds - t2w0.flow_seconds, t2w1.hift_seconds - t2w0.hift_seconds
    tokens = lm1.tokens_generated - lm0.tokens_generated
    return {
        "lm_tokens": tokens,
        "lm_tokens_per_s": tokens / wall,
        "flow_calls": flow_calls,
        "flow_s": flow_s,
        "flow_ms_per_call": 1000 * flow_s / flow_calls if flow_calls else None,
        "hift_calls": hift_calls,
        "hift_s": hift_s,
        "hift_ms_per_call": 1000 * hift_s / hift_calls if hift_calls else None,
        # HiFT's launches (Token2WavStats): wall time, and the launching thread's CPU time in it
        "hift_launch_s": t2w1.hift_launch_seconds - t2w0.hift_launch_seconds,
        "hift_launch_cpu_s": t2w1.hift_launch_cpu_seconds - t2w0.hift_launch_cpu_seconds,
        "eager_flow_calls": t2w1.eager_flow_calls - t2w0.eager_flow_calls,
        "graph_captures": t2w1.graph_captures - t2w0.graph_captures,
        "graph_capture_s": t2w1.graph_capture_seconds - t2w0.graph_capture_seconds,
        "incremental_jobs": t2w1.incremental_jobs - t2w0.incremental_jobs,
        "recompute_jobs": t2w1.recompute_jobs - t2w0.recompute_jobs,
        # Mel frames the flow handed its jobs, and the frames it ran per item for them (padding and a
        # recompute's prefix included), per path (Token2WavStats)
        **{
            f"{path}_{kind}": getattr(t2w1, f"{path}_{kind}") - getattr(t2w0, f"{path}_{kind}")
            for path in ("incremental", "recompute")
            for kind in ("frames", "run_frames")
        },
        "flow_cache_fallbacks": t2w1.flow_cache_fallbacks - t2w0.flow_cache_fallbacks,
        # The fewest pages free at once since the worker started (its earlier levels included): with
        # the pool's size, what the pool needed at most.
        "flow_cache_least_free": t2w1.flow_cache_least_free,
        # --compile-flow: compiles that ended inside the level (the compile thread shares the host)
        "flow_compiles": t2w1.flow_compiles - t2w0.flow_compiles,
        "compiles_elsewhere": t2w1.compiles_elsewhere - t2w0.compiles_elsewhere,
        # --lm-yield-ms: the worker's holds on the LM and the seconds the LM waited in them
        "lm_holds": t2w1.lm_holds - t2w0.lm_holds,
        "lm_hold_s": t2w1.lm_hold_seconds - t2w0.lm_hold_seconds,
        "lm_waited_s": t2w1.lm_waited_seconds - t2w0.lm_waited_seconds,
        # fill_ms: steps that waited for more jobs, and their waits
        "fills": t2w1.fills - t2w0.fills,
        "fill_s": t2w1.fill_seconds - t2w0.fill_seconds,
        # late_step_frames_per_row: steps bound by it (their most urgent stream dry for a second)
        "late_steps": t2w1.late_steps - t2w0.late_steps,
    }


# The caching allocator's counters a level reports as they grew during it: cudaMalloc calls that
# failed and were retried after freeing every cached block (which first synchronises every stream of
# the process, so a HiFT call would wait for the flow call running beside it), those frees of the
# cache, and the cudaMalloc and cudaFree calls.
ALLOCATOR_COUNTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")
_counts_at_reset: dict[str, int] = {}


def reset_gpu_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        stats = torch.cuda.memory_stats()
        _counts_at_reset.update({name: stats.get(name, 0) for name in ALLOCATOR_COUNTS})


def gpu_memory() -> dict:
    """This process's peak allocation since ``reset_gpu_peak`` (flow, HiFT, a PyTorch LM), the memory
    used on the whole device now (vLLM's engine process and its KV cache included), and the caching
    allocator's peak reservation and ALLOCATOR_COUNTS since then (``gpu_allocator``)."""
    if not torch.cuda.is_available():
        return {"gpu_peak_allocated_gb": None, "gpu_device_used_gb": None, "gpu_allocator": None}
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    counts = {name: stats.get(name, 0) - _counts_at_reset.get(name, 0) for name in ALLOCATOR_COUNTS}
    return {
        "gpu_peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        "gpu_device_used_gb": (total - free) / 2**30,
        "gpu_allocator": {"peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30} | counts,
    }
