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
    hift_calls: int = 0
    hift_seconds: float = 0.0
    # The incremental flow's CUDA graphs: calls that ran eagerly for want of their bucket's graph,
    # and the deferred captures (made while the worker had nothing queued) with their time.
    eager_flow_calls: int = 0
    graph_captures: int = 0
    graph_capture_seconds: float = 0.0
