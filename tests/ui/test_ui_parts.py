"""The UI's building blocks without a server: WAV chunks, stats, errors, the metrics sampler."""

import io
import os
import time

import numpy as np
import pytest
import soundfile as sf

from cosyapp.codec import wav
from cosyapp.engine.metrics import Metrics
from cosyapp.errors import BusyError, TextError, VoiceError, VoiceNotFoundError
from cosyapp.web.ui.audio import ClipFolder
from cosyapp.web.ui.events import INTERNAL_ERROR, as_toast, request_stats
from cosyapp.web.ui.panel import MetricsHistory, history_of, plot_frames, stat_tiles


def test_chunks_are_16_bit_mono_wav_of_the_same_samples():
    samples = np.array([0.0, 0.5, -0.5, 1.5, -2.0], np.float32)
    decoded, rate = sf.read(io.BytesIO(wav(samples, 24_000)), dtype="int16")
    info = sf.info(io.BytesIO(wav(samples, 24_000)))
    assert (rate, info.channels, info.subtype) == (24_000, 1, "PCM_16")
    assert decoded.tolist() == [0, 16384, -16384, 32767, -32767]


def test_clip_files_are_wavs_and_old_ones_are_removed(tmp_path):
    clips = ClipFolder(max_age_s=60)
    old = clips.write(np.zeros(480, np.float32), 24_000)
    os.utime(old, (time.time() - 120, time.time() - 120))
    new = clips.write(np.full(960, 0.1, np.float32), 24_000)
    assert not old.exists()
    assert sf.info(new).frames == 960 and new.suffix == ".wav"


def test_stats_line_reports_ttfa_rtf_and_length():
    line = request_stats(48_000, 24_000, elapsed=1.0, ttfa=0.25)
    assert line == "TTFA **0.25 s** · RTF **0.50** · audio **2.00 s** (48,000 samples at 24,000 Hz)"
    assert "batch of **4**" in request_stats(24_000, 24_000, elapsed=2.0, batch=4)


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (TextError("the text has no speakable characters"), "The text has no speakable characters"),
        (VoiceNotFoundError("user-0123456789ab"), "Voice 'user-0123456789ab' not found; pick one"),
        (VoiceError("bad <b>name</b>"), "Bad &lt;b&gt;name&lt;/b&gt;"),
        (BusyError("the server is busy; try again"), "The server is busy; try again"),
    ],
)
def test_user_errors_become_readable_escaped_toasts(error, message):
    assert as_toast(error).message.startswith(message)


@pytest.mark.parametrize("error", [ValueError("bad <b>name</b> at 0x7f"), KeyError("features"), OSError(5)])
def test_any_other_error_is_a_generic_toast_and_logged_in_full(error, caplog):
    assert as_toast(error).message == INTERNAL_ERROR
    (record,) = caplog.records
    assert record.levelname == "ERROR" and record.exc_info[1] is error


def test_one_sampler_per_metrics_and_reading_it_records_nothing():
    metrics = Metrics()
    history = history_of(metrics)
    assert history_of(metrics) is history
    time.sleep(0.05)
    count = len(history.samples())
    for _ in range(5):  # what every page's timer tick does
        stat_tiles(metrics.snapshot())
        plot_frames(history.samples())
    assert len(history.samples()) == count


def test_history_keeps_the_last_minutes_in_a_ring():
    metrics = Metrics()
    metrics.gauges["queue_depth"] = lambda: 3
    history = MetricsHistory(metrics, period_s=1.0, span_s=5)
    for _ in range(8):
        history.sample()
    load, audio, ttfa = plot_frames(history.samples())
    assert len(history.samples()) == 5
    assert load[load.series == "queue depth"]["count"].tolist() == [3] * 5
    assert len(audio) == 5 and ttfa.empty
