import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
HOSTING_VARIABLES = ("GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT", "PORT", "SPACE_ID")


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any COSYAPP_* or hosting variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYAPP_") and k not in HOSTING_VARIABLES}
    return env | extra


def app_help(**env: str) -> str:
    command = [sys.executable, "app.py", "--help"]
    return subprocess.run(
        command, cwd=REPO, env=clean_env(**env), capture_output=True, text=True, check=True
    ).stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_app(tmp_path: Path, *flags: str, **env: str):
    """``python app.py --demo`` on a fresh cache and data folder; yields (base URL, log path) once /health
    answers 200, then sends SIGTERM and checks that it stopped its engines and exited."""
    port = free_port()
    log_path = tmp_path / "app.log"
    folders = ["--cache-dir", str(tmp_path / "cache"), "--data-dir", str(tmp_path / "data")]
    command = [sys.executable, "app.py", "--demo", "--port", str(port), *folders]
    command += ["--engine", "torch", "--device", "cpu", *flags]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=clean_env(**env), stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"app.py exited early:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"no healthy server in time:\n{log_path.read_text()}"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield base, log_path
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            returncode = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    # uvicorn re-raises the signal it handled once it has shut down, so -SIGTERM is a clean exit too
    assert returncode in (0, -signal.SIGTERM) and "engines stopped" in log_path.read_text(), (
        log_path.read_text()
    )


def test_help_lists_the_flags_with_their_environment_variables():
    out = app_help()
    for flag, env in [
        ("--model", "COSYAPP_MODEL"),
        ("--demo", "COSYAPP_DEMO"),
        ("--device", "COSYAPP_DEVICE"),
        ("--engine", "COSYAPP_ENGINE"),
        ("--host", "COSYAPP_HOST"),
        ("--port", "COSYAPP_PORT"),
        ("--share", "COSYAPP_SHARE"),
        ("--gpu-memory-utilization", "COSYAPP_GPU_MEMORY_UTILIZATION"),
        ("--max-streams", "COSYAPP_MAX_STREAMS"),
        ("--max-text-chars", "COSYAPP_MAX_TEXT_CHARS"),
        ("--cache-dir", "COSYAPP_CACHE_DIR"),
        ("--data-dir", "COSYAPP_DATA_DIR"),
    ]:
        assert flag in out and env in out


def test_help_imports_neither_torch_nor_gradio():
    code = """
import runpy, sys
sys.argv = ["app.py", "--help"]
try:
    runpy.run_path("app.py", run_name="__main__")
except SystemExit:
    pass
assert "torch" not in sys.modules and "gradio" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, check=True)


def test_a_space_listens_on_every_interface_at_the_port_it_is_given():
    out = " ".join(app_help(SPACE_ID="user/cosyapp", GRADIO_SERVER_PORT="7861").split())
    assert "(default: 0.0.0.0;" in out and "(default: 7861;" in out


def test_port_variables_yield_to_cosyapp_variables():
    out = " ".join(app_help(PORT="8080", GRADIO_SERVER_NAME="0.0.0.0", COSYAPP_HOST="10.0.0.1").split())
    assert "(default: 8080;" in out and "(default: 10.0.0.1;" in out


def test_settings_read_the_environment(monkeypatch, tmp_path):
    from cosyapp.settings import parse_settings

    monkeypatch.setenv("COSYAPP_MODEL", str(tmp_path))
    monkeypatch.setenv("COSYAPP_DEMO", "1")
    settings = parse_settings([])
    assert settings.model == str(tmp_path) and settings.demo
    assert parse_settings(["--model", "org/name"]).model == "org/name"


def test_first_hop_reaches_the_engine_and_stays_in_the_range_every_speed_can_stream(monkeypatch, capsys):
    from cosyapp.options import MAX_HOP, MIN_FIRST_HOP
    from cosyapp.settings import parse_settings

    monkeypatch.setenv("COSYAPP_FIRST_HOP", "12")
    assert parse_settings([]).serve_options().first_hop == 12
    for bad in (str(MIN_FIRST_HOP - 1), str(MAX_HOP + 1)):
        with pytest.raises(SystemExit):
            parse_settings(["--first-hop", bad])
        assert "--first-hop must be between 10 and 100" in capsys.readouterr().err


def test_the_lowest_first_hop_streams_at_the_highest_speed_and_one_less_cannot(tiny_model):
    import torch

    from cosyapp.engine.pipeline import MAX_SPEED
    from cosyapp.engine.token2wav.worker import Token2Wav
    from cosyapp.models.cosyvoice2 import PromptInputs
    from cosyapp.options import MIN_FIRST_HOP

    g = torch.Generator().manual_seed(0)
    prompt = PromptInputs(
        text_ids=torch.zeros(1, dtype=torch.long),
        speech_tokens=torch.randint(0, 6561, (75,), generator=g),
        speech_feat=torch.randn(150, 80, generator=g),
        embedding=torch.randn(192, generator=g),
    )
    stream = Token2Wav(tiny_model, first_hop=MIN_FIRST_HOP).open_stream(prompt, speed=MAX_SPEED)
    assert stream.schedule.hop() == MIN_FIRST_HOP  # 75 prompt tokens: no alignment pad
    with pytest.raises(ValueError, match="too high for streaming"):
        Token2Wav(tiny_model, first_hop=MIN_FIRST_HOP - 1).open_stream(prompt, speed=MAX_SPEED)


def test_the_demo_app_serves_the_page_and_health_then_stops_cleanly(tmp_path):
    with running_app(tmp_path) as (base, log_path):
        page = httpx.get(base, timeout=30)
        health = httpx.get(f"{base}/health", timeout=30).json()
    assert page.status_code == 200 and "gradio" in page.text.lower()
    assert health["demo"] and health["engine"] == "torch"
    assert "DEMO MODE" in log_path.read_text()


def test_share_offline_says_so_and_serves_the_ui_and_the_api_locally(tmp_path):
    dead_proxy = "http://127.0.0.1:9"  # nothing listens there: no share link can be made, even online
    no_internet = {"HTTPS_PROXY": dead_proxy, "HTTP_PROXY": dead_proxy, "NO_PROXY": "127.0.0.1,localhost"}
    with running_app(tmp_path, "--share", **no_internet) as (base, log_path):
        page = httpx.get(base, timeout=30)
        voices = httpx.get(f"{base}/v1/audio/voices", timeout=30).json()["data"]
        # The local server answers before Gradio gives up on the share server: wait for that verdict.
        deadline = time.monotonic() + 60
        while "Could not create share link" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    log = log_path.read_text()
    assert "ANYONE with the link can use this app" in log and "Could not create share link" in log
    assert "gradio" in page.text.lower() and "zh-aishell-w0121" in {v["id"] for v in voices}
