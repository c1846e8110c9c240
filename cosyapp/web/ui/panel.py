"""The live panel: engine numbers and small plots of the last minutes, refreshed every second.

History is sampled by ONE background thread per Metrics object (``history_of``); the per-page timer
ticks only read it, so the number of open pages changes nothing about what is recorded.
"""

import html
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

import gradio as gr
import pandas as pd

from cosyapp.engine.metrics import Metrics

log = logging.getLogger(__name__)
SPAN_S = 180  # seconds of history in the plots
PERIOD_S = 1.0


@dataclass(frozen=True)
class Sample:
    """The numbers plotted, at one moment (``time`` from ``time.monotonic``)."""

    time: float
    active_streams: float
    queue_depth: float
    audio_per_s: float
    tokens_per_s: float
    ttfa_p50: float | None


class MetricsHistory:
    """A ring of samples of one Metrics, taken every ``period_s`` by a daemon thread."""

    def __init__(self, metrics: Metrics, period_s: float = PERIOD_S, span_s: float = SPAN_S):
        self.metrics = metrics
        self.period_s = period_s
        self._samples: deque[Sample] = deque(maxlen=int(span_s / period_s))
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (idempotent)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cosyapp-metrics", daemon=True)
                self._thread.start()

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def sample(self) -> None:
        """Take one sample now."""
        snap = self.metrics.snapshot()
        sample = Sample(
            time=time.monotonic(),
            active_streams=snap["active_streams"],
            queue_depth=snap.get("queue_depth", 0),
            audio_per_s=snap["audio_per_s_10s"],
            tokens_per_s=snap["tokens_per_s_10s"],
            ttfa_p50=snap["ttfa_p50_10s"],
        )
        with self._lock:
            self._samples.append(sample)

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # a failing gauge must not end the panel's history for good
                log.exception("sampling the metrics failed")
            time.sleep(self.period_s)


_histories: "weakref.WeakKeyDictionary[Metrics, MetricsHistory]" = weakref.WeakKeyDictionary()
_histories_lock = threading.Lock()


def history_of(metrics: Metrics) -> MetricsHistory:
    """The one started sampler of ``metrics`` in this process."""
    with _histories_lock:
        history = _histories.get(metrics)
        if history is None:
            history = _histories[metrics] = MetricsHistory(metrics)
    history.start()
    return history


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} s"


def stat_tiles(snap: dict) -> str:
    """The panel's numbers as HTML tiles (they wrap on narrow screens)."""
    tiles = [
        ("active streams", f"{snap['active_streams']}"),
        ("queue depth", f"{snap.get('queue_depth', 0)}"),
        ("TTFA p50 · 60 s", _seconds(snap["ttfa_p50_60s"])),
        ("TTFA p99 · 60 s", _seconds(snap["ttfa_p99_60s"])),
        ("audio s per s · 10 s", f"{snap['audio_per_s_10s']:.2f}"),
        ("tokens per s · 10 s", f"{snap['tokens_per_s_10s']:.0f}"),
        ("batch LM / token2wav", f"{snap.get('lm_batch_size', 0)} / {snap.get('token2wav_batch_size', 0)}"),
        ("GPU memory", f"{snap.get('gpu_memory_gb', 0.0):.2f} GB"),
        ("requests done", f"{snap['done']} of {snap['requests']}"),
    ]
    replicas = snap.get("replicas", [])
    if len(replicas) > 1:  # --replicas: each one's load, or that it is down (restarting)
        tiles += [(f"replica {r['replica']}", _replica_load(r)) for r in replicas]
    cells = "".join(
        f'<div class="tile"><span class="value">{html.escape(value)}</span>'
        f'<span class="name">{html.escape(name)}</span></div>'
        for name, value in tiles
    )
    return f'<div class="live-stats">{cells}</div>'


def _replica_load(line: dict) -> str:
    if line["status"] != "serving":
        return line["status"]
    return f"{line['active_streams']} streams · {line['queued_jobs']} jobs"


def plot_frames(samples: list[Sample]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Long-format frames for the three plots, x = seconds before now."""
    now = time.monotonic()
    ago = [round(s.time - now, 1) for s in samples]
    load = pd.DataFrame(
        {
            "seconds": ago * 2,
            "count": [s.active_streams for s in samples] + [s.queue_depth for s in samples],
            "series": ["active streams"] * len(samples) + ["queue depth"] * len(samples),
        }
    )
    audio = pd.DataFrame({"seconds": ago, "audio s per s": [s.audio_per_s for s in samples]})
    timed = [(a, s.ttfa_p50) for a, s in zip(ago, samples, strict=True) if s.ttfa_p50 is not None]
    ttfa = pd.DataFrame(
        {
            "seconds": pd.Series([a for a, _ in timed], dtype=float),
            "TTFA p50 (s)": pd.Series([t for _, t in timed], dtype=float),
        }
    )
    return load, audio, ttfa


def build_panel(metrics: Metrics) -> None:
    """Render the live panel into the current Blocks and wire its 1 s timer."""
    history = history_of(metrics)
    if not history.samples():
        history.sample()  # the plots infer their axis types from the first frame they get
    load, audio, ttfa = plot_frames(history.samples())
    common = {
        "x": "seconds",
        "x_lim": [-SPAN_S, 0],
        "y_lim": [0, None],
        "y_axis_format": "~g",
        "min_width": 240,
    }
    with gr.Accordion("Live server panel (all sessions)", open=True):
        tiles = gr.HTML(stat_tiles(metrics.snapshot()), elem_id="live-stats")
        with gr.Row(equal_height=True):
            load_plot = gr.LinePlot(load, y="count", color="series", label="streams and queue", **common)
            audio_plot = gr.LinePlot(audio, y="audio s per s", label="audio seconds per second", **common)
            ttfa_plot = gr.LinePlot(ttfa, y="TTFA p50 (s)", label="time to first audio, p50", **common)

    def refresh():
        return stat_tiles(metrics.snapshot()), *plot_frames(history.samples())

    gr.Timer(PERIOD_S).tick(
        refresh,
        None,
        [tiles, load_plot, audio_plot, ttfa_plot],
        queue=False,
        show_progress="hidden",
        api_name=False,
    )
