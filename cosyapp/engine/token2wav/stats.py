"""The token2wav worker's counters (worker.py writes them, the metrics and the benchmark read them)."""

from dataclasses import dataclass


@dataclass
class Token2WavStats:
    """Worker counters; read without blocking the worker."""

    jobs_done: int = 0  # chunk jobs computed and delivered
    jobs_dropped: int = 0  # jobs of ended (cancelled or failed) streams skipped before any computation
    last_flow_batch: int = 0  # items in the most recent flow call
    max_flow_batch: int = 0
    last_hift_batch: int = 0  # items in the most recent HiFT call
    max_hift_batch: int = 0
    queue_depth: int = 0  # jobs waiting for the worker
    flow_calls: int = 0
    flow_seconds: float = 0.0  # wall time of flow calls, device work included
    overlapped_steps: int = 0  # steps whose incremental call ran beside recompute calls (flow_overlap)
    hift_calls: int = 0
    hift_seconds: float = 0.0
    # Of those: from a call's start to its last kernel launched, in wall time and in the launching
    # thread's CPU time. Launches far longer than their CPU time waited: for the interpreter lock, a
    # lock, or the driver (docs/benchmarks/README.md, twelfth round).
    hift_launch_seconds: float = 0.0
    hift_launch_cpu_seconds: float = 0.0
    # The incremental flow's CUDA graphs: calls that ran eagerly for want of their bucket's graph,
    # and the deferred captures (made while the worker had nothing queued) with their time.
    eager_flow_calls: int = 0
    graph_captures: int = 0
    graph_capture_seconds: float = 0.0
    # Chunk jobs by flow path: incremental (from a stream's pages) or recomputed over the prefix (whole
    # clips, upstream's full-attention last chunks, streams the pool could not serve); the times the
    # pool could not serve a stream; its pages, those free now and the fewest ever free at once (0
    # without a pool).
    incremental_jobs: int = 0
    recompute_jobs: int = 0
    # Mel frames the flow handed its jobs, and the frames its estimator ran per item for them, padding
    # included (a recompute's prompt and earlier tokens, the longest item of its call; an incremental
    # call's shape bucket), by path: their ratio is the flow's work per delivered frame. A recompute
    # graph's own bucket (rows, 128 frames) is not counted.
    incremental_frames: int = 0
    incremental_run_frames: int = 0
    recompute_frames: int = 0
    recompute_run_frames: int = 0
    flow_cache_fallbacks: int = 0
    flow_cache_pages: int = 0
    flow_cache_free_pages: int = 0
    flow_cache_least_free: int = 0
    # --compile-flow's compile thread (compiling.py, one per process): kinds of call compiled (failures
    # included) and their time; whether compiles or the recaptures after them are still to come; the
    # compiles dynamo started on other threads meanwhile (a serving thread waiting for one: 0 is right).
    flow_compiles: int = 0
    flow_compile_seconds: float = 0.0
    flow_compiling: bool = False
    compiles_elsewhere: int = 0
    # --lm-yield-ms (yielding.py): steps that held the LM, the holds' seconds, and the seconds the LM
    # waited in them (the gate's count: every worker of the process).
    lm_holds: int = 0
    lm_hold_seconds: float = 0.0
    lm_waited_seconds: float = 0.0
    # fill_ms (scheduler.py): steps that waited for more jobs, and their waits' seconds.
    fills: int = 0
    fill_seconds: float = 0.0
    # late_step_frames_per_row (scheduler.py): steps bound by late_step_frames (a late job first).
    late_steps: int = 0
