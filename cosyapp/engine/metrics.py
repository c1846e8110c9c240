"""Serving metrics: per request (TTFA, total time, audio seconds, RTF) and engine-wide rolling windows.

Everything is recorded from the asyncio side of the engine in O(1) and read under a short lock, so a
reader (the live panel, /metrics) never waits on GPU work.
"""

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOWS = (10.0, 60.0)


@dataclass
class RequestRecord:
    """Timeline of one synthesis request (times from ``time.monotonic``)."""

    request_id: str
    mode: str = "zero_shot"  # frontend/modes.py
    started: float = field(default_factory=time.monotonic)
    first_audio: float | None = None
    finished: float | None = None
    audio_seconds: float = 0.0
    tokens: int = 0
    status: str = "running"  # running, done, cancelled, failed

    @property
    def ttfa(self) -> float | None:
        """Seconds from arrival to the first audio chunk."""
        return None if self.first_audio is None else self.first_audio - self.started

    @property
    def total(self) -> float | None:
        return None if self.finished is None else self.finished - self.started

    @property
    def rtf(self) -> float | None:
        """Real-time factor: wall seconds per second of audio (lower is faster)."""
        if self.total is None or self.audio_seconds <= 0:
            return None
        return self.total / self.audio_seconds


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank, or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Metrics:
    """Thread-safe rolling metrics. ``gauges`` are callables read at snapshot time (engine stats)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, horizon: float = max(WINDOWS)):
        self.clock = clock
        self.horizon = horizon
        self._lock = threading.Lock()
        self._finished: deque[RequestRecord] = deque()
        self._audio: deque[tuple[float, float]] = deque()  # (time, seconds of audio delivered)
        self._tokens: deque[tuple[float, int]] = deque()  # (time, speech tokens decoded)
        self._active: dict[str, RequestRecord] = {}
        self.totals = {"requests": 0, "done": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.by_mode: Counter[tuple[str, str]] = Counter()  # (mode, outcome) of finished requests
        self.gauges: dict[str, Callable[[], float]] = {}

    def begin(self, request_id: str, mode: str = "zero_shot") -> RequestRecord:
        record = RequestRecord(request_id, mode, started=self.clock())
        with self._lock:
            self._active[request_id] = record
            self.totals["requests"] += 1
        return record

    def rejected(self) -> None:
        with self._lock:
            self.totals["rejected"] += 1

    def audio(self, record: RequestRecord, seconds: float) -> None:
        now = self.clock()
        with self._lock:
            if record.first_audio is None:
                record.first_audio = now
            record.audio_seconds += seconds
            self._audio.append((now, seconds))

    def tokens(self, record: RequestRecord, count: int) -> None:
        with self._lock:
            record.tokens += count
            self._tokens.append((self.clock(), count))

    def end(self, record: RequestRecord, status: str) -> None:
        with self._lock:
            record.finished = self.clock()
            record.status = status
            self._active.pop(record.request_id, None)
            self._finished.append(record)
            self.totals[status] += 1
            self.by_mode[record.mode, status] += 1
            self._trim(record.finished)

    def _trim(self, now: float) -> None:
        cutoff = now - self.horizon
        for queue in (self._audio, self._tokens):
            while queue and queue[0][0] < cutoff:
                queue.popleft()
        while self._finished and (self._finished[0].finished or 0) < cutoff:
            self._finished.popleft()

    def snapshot(self) -> dict[str, float | int | None]:
        """Current values: per window TTFA p50/p99, RTF p50, audio s/s, tokens/s; active; totals; gauges."""
        now = self.clock()
        with self._lock:
            self._trim(now)
            finished = list(self._finished)
            audio = list(self._audio)
            tokens = list(self._tokens)
            out: dict[str, float | int | None] = {"active_streams": len(self._active), **self.totals}
        for window in WINDOWS:
            tag = f"{int(window)}s"
            recent = [r for r in finished if (r.finished or 0) >= now - window and r.status == "done"]
            ttfas = [r.ttfa for r in recent if r.ttfa is not None]
            rtfs = [r.rtf for r in recent if r.rtf is not None]
            out[f"ttfa_p50_{tag}"] = percentile(ttfas, 0.5)
            out[f"ttfa_p99_{tag}"] = percentile(ttfas, 0.99)
            out[f"rtf_p50_{tag}"] = percentile(rtfs, 0.5)
            out[f"audio_per_s_{tag}"] = sum(s for t, s in audio if t >= now - window) / window
            out[f"tokens_per_s_{tag}"] = sum(n for t, n in tokens if t >= now - window) / window
        for name, read in self.gauges.items():
            out[name] = read()
        return out

    def prometheus(self) -> str:
        """The snapshot in Prometheus text exposition format (``cosyapp_`` prefix).

        Requests started are one counter, finished or refused ones another labelled by outcome,
        finished ones a third labelled by mode and outcome; everything else is a gauge.
        """
        snapshot = self.snapshot()
        with self._lock:
            by_mode = sorted(self.by_mode.items())
        lines = ["# TYPE cosyapp_requests_started_total counter"]
        lines.append(f"cosyapp_requests_started_total {snapshot.pop('requests')}")
        lines.append("# TYPE cosyapp_requests_total counter")
        for outcome in [key for key in self.totals if key != "requests"]:
            lines.append(f'cosyapp_requests_total{{outcome="{outcome}"}} {snapshot.pop(outcome)}')
        lines.append("# TYPE cosyapp_mode_requests_total counter")
        for (mode, outcome), count in by_mode:
            lines.append(f'cosyapp_mode_requests_total{{mode="{mode}",outcome="{outcome}"}} {count}')
        for name, value in snapshot.items():
            if isinstance(value, int | float):  # numbers only: a cluster labels its replicas' own
                lines += [f"# TYPE cosyapp_{name} gauge", f"cosyapp_{name} {float(value):.6g}"]
        return "\n".join(lines) + "\n"
