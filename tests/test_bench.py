import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_smoke_benchmark_writes_consistent_json(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, "-m", "cosyapp.bench", "--smoke", "--engine", "torch", "--device", "cpu",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["engine"] == "TorchSpeechLM" and result["tokens_per_request"] == 40
    levels = result["levels"]
    assert [(lv["clients"], lv["streaming"]) for lv in levels] == [(1, True), (4, True)]
    for level in levels:
        # Endless model: every request decodes exactly 40 tokens = 1.6 s of audio.
        assert level["audio_s"] == pytest.approx(level["clients"] * 40 / 25)
        assert 0 < level["ttfa_p50"] <= level["ttfa_p99"] <= level["wall_s"]
        assert level["rtf_aggregate"] == pytest.approx(level["wall_s"] / level["audio_s"])
        assert 1 <= level["lm_max_batch"] <= level["clients"]
        assert level["flow_calls"] >= 1 and level["flow_ms_per_call"] > 0
    baselines = result["baselines"]
    assert set(baselines) == {"a_sequential_reference", "b_engine_lm_serial_token2wav", "c_torch_engine"}
    for name in ("a_sequential_reference", "b_engine_lm_serial_token2wav"):
        base = baselines[name]
        assert base["clients"] == 4 and base["audio_s"] == pytest.approx(4 * 40 / 25)
        assert base["ttfa_p50"] <= base["ttfa_p99"] <= base["wall_s"]
        assert base["cosyapp_throughput_ratio"] == pytest.approx(
            levels[-1]["audio_per_wall_s"] / base["audio_per_wall_s"]
        )
