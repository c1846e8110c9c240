"""The soak test in its short form: the app on loopback, a few clients mixing good and bad requests
for 30 s (``python -m cosyapp.soak`` runs the long form)."""

import io
import json
import os
import wave

import numpy as np
import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from cosyapp.soak.run import KINDS, Tally, WrongAnswer, main, run_soak  # noqa: E402


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    """The summary of one 30 s soak: 3 clients, 2 stream slots, 6 waves after the warm-up."""
    summary = run_soak(
        seconds=30, clients=3, max_streams=2, seed=0, home=tmp_path_factory.mktemp("soak"), waves=6
    )
    print(json.dumps(summary, indent=2))
    return summary


def test_a_short_soak_answers_every_request_correctly(soak):
    summary = soak
    assert summary["wrong"] == {}, summary["wrong_examples"]
    answered = {kind: summary["ok"].get(kind, 0) + summary["busy"].get(kind, 0) for kind in KINDS}
    assert sum(answered.values()) == summary["requests"] >= 20
    assert summary["ok"].get("api_whole", 0) > 0 and summary["ok"].get("bad_json", 0) > 0
    assert summary["distinct_clips_checked"] >= 1
    assert summary["health_after"] == {
        "status": "serving",
        "active_streams": 0,
        "waiting": 0,
        "lm_restarts": 0,
    }


def test_a_short_soak_leaks_nothing(soak):
    # Median growth from one wave to the next, sampled with nothing in flight (soak/memory.py says
    # why not RSS). Objects grow by design while the first minutes fill the UI's stats ring (one per
    # second) and the metrics' window (one per request): about two per request here. A leak of a
    # tensor per request, of a stream's worth of objects, or of 1 MB per request reaches a bound.
    growth, waves = soak["growth_per_wave"], soak["after_each_wave"]
    assert growth["requests"] >= 3, waves  # every client sends at least one request per wave
    assert growth["tensors"] < 3 and growth["objects"] < 5 * growth["requests"], waves
    assert growth["heap_kb"] < 5_000, waves


def test_the_soak_command_refuses_a_nonsense_duration(capsys):
    try:
        main(["--seconds", "0"])
    except SystemExit as exit:
        assert exit.code == 2
    assert "must be positive" in capsys.readouterr().err


def _wav(samples: list[int]) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(24000)
        writer.writeframes(np.array(samples, dtype="<i2").tobytes())
    return buffer.getvalue()


def test_answers_to_one_request_may_differ_by_float_rounding_but_not_more():
    tally = Tally()
    tally.same_clip(("Hi.", 1), _wav([0, 100, -200, 300]))
    tally.same_clip(("Hi.", 1), _wav([1, 98, -200, 301]))  # batched differently: last-bit rounding
    with pytest.raises(WrongAnswer, match="by 3 steps"):
        tally.same_clip(("Hi.", 1), _wav([0, 103, -200, 300]))
    with pytest.raises(WrongAnswer, match="gave 3 samples"):
        tally.same_clip(("Hi.", 1), _wav([0, 100, -200]))
