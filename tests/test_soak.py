"""The soak test in its short form: the app on loopback, a few clients mixing good and bad requests
for 30 s (``python -m cosyapp.bench.soak`` runs the long form)."""

import io
import json
import os
import wave

import numpy as np
import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from cosyapp.bench.soak import KINDS, Tally, WrongAnswer, main, run_soak  # noqa: E402


def test_a_short_soak_answers_every_request_correctly(tmp_path):
    summary = run_soak(seconds=30, clients=3, max_streams=2, seed=0, home=tmp_path)
    print(json.dumps({k: v for k, v in summary.items() if k != "rss_samples"}, indent=2))
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
    rss = summary["rss_mb"]
    assert rss["max_second_half"] - rss["max_first_half"] < 150  # RSS levels off (MB)


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
