import pytest

from cosyapp.engine.metrics import Metrics, percentile


class FakeClock:
    """A settable clock: the metrics take time as a dependency, like any rolling-window code."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def run_request(metrics, clock, request_id, ttfa, total, audio_seconds, status="done"):
    record = metrics.begin(request_id)
    clock.now += ttfa
    metrics.audio(record, audio_seconds)
    clock.now += total - ttfa
    metrics.end(record, status)
    return record


def test_request_record_gives_ttfa_total_and_rtf():
    clock = FakeClock()
    metrics = Metrics(clock)
    record = run_request(metrics, clock, "a", ttfa=0.2, total=2.0, audio_seconds=4.0)
    assert record.ttfa == pytest.approx(0.2) and record.total == pytest.approx(2.0)
    assert record.rtf == pytest.approx(0.5)


def test_windows_forget_old_requests():
    clock = FakeClock()
    metrics = Metrics(clock)
    run_request(metrics, clock, "old", ttfa=1.0, total=1.0, audio_seconds=1.0)
    clock.now += 30
    run_request(metrics, clock, "new", ttfa=0.1, total=0.5, audio_seconds=2.0)
    snap = metrics.snapshot()
    assert snap["ttfa_p50_10s"] == pytest.approx(0.1)
    assert snap["ttfa_p99_60s"] == pytest.approx(1.0)
    assert snap["audio_per_s_10s"] == pytest.approx(2.0 / 10)
    clock.now += 61
    assert metrics.snapshot()["ttfa_p50_60s"] is None


def test_active_streams_and_outcome_totals():
    clock = FakeClock()
    metrics = Metrics(clock)
    running = metrics.begin("r")
    run_request(metrics, clock, "c", 0.1, 0.2, 0.5, status="cancelled")
    metrics.rejected()
    snap = metrics.snapshot()
    assert snap["active_streams"] == 1 and snap["cancelled"] == 1 and snap["rejected"] == 1
    metrics.end(running, "failed")
    assert metrics.snapshot()["active_streams"] == 0


def test_tokens_per_second_and_gauges():
    clock = FakeClock()
    metrics = Metrics(clock)
    record = metrics.begin("t")
    for _ in range(50):
        metrics.tokens(record, 2)
    metrics.gauges["lm_batch_size"] = lambda: 7
    snap = metrics.snapshot()
    assert snap["tokens_per_s_10s"] == pytest.approx(10.0) and snap["lm_batch_size"] == 7


def test_prometheus_text_has_counters_and_gauges():
    clock = FakeClock()
    metrics = Metrics(clock)
    run_request(metrics, clock, "a", 0.25, 1.0, 2.0)
    text = metrics.prometheus()
    assert 'cosyapp_requests_total{outcome="done"} 1' in text and "cosyapp_requests_started_total 1" in text
    assert 'outcome="requests"' not in text
    assert "# TYPE cosyapp_ttfa_p50_10s gauge\ncosyapp_ttfa_p50_10s 0.25\n" in text
    assert "None" not in text


def test_percentile_by_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(101)], 0.99) == 99.0
