import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_help_lists_the_flags_with_their_environment_variables():
    out = subprocess.run(
        [sys.executable, "app.py", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    )
    for flag, env in [
        ("--model", "COSYAPP_MODEL"),
        ("--demo", "COSYAPP_DEMO"),
        ("--device", "COSYAPP_DEVICE"),
    ]:
        assert flag in out.stdout and env in out.stdout


def test_settings_read_the_environment(monkeypatch, tmp_path):
    from cosyapp.settings import parse_settings

    monkeypatch.setenv("COSYAPP_MODEL", str(tmp_path))
    monkeypatch.setenv("COSYAPP_DEMO", "1")
    settings = parse_settings([])
    assert settings.model == str(tmp_path) and settings.demo
    assert parse_settings(["--model", "org/name"]).model == "org/name"
