"""The soak test in its short form: the app on loopback, a few clients mixing good and bad requests
for 30 s (``python -m cosyapp.soak`` runs the long form)."""

import json
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from cosyapp.soak import KINDS, main, run_soak  # noqa: E402


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
