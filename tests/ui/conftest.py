"""One running web UI per test session (tiny model, CPU) and Debian's Chromium for Playwright."""

import os
import shutil
import socket
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--autoplay-policy=no-user-gesture-required",
]


@dataclass
class RunningUI:
    service: object  # cosyapp.service.Service
    demo: object  # gradio.Blocks
    url: str

    def fetch(self, url: str) -> bytes:
        """GET a URL of the app (absolute, or relative to its root)."""
        if not url.startswith("http"):
            url = self.url.rstrip("/") + "/" + url.lstrip("/")
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched_ui(home: Path, **overrides):
    """The app over the tiny model in ``home``, launched as users get it (queue, batching, launch
    options); ``overrides``: Settings fields beside the test defaults."""
    from cosyapp.service import build_service
    from cosyapp.settings import Settings
    from cosyapp.web.ui import build_demo, launch_options

    options = {"demo": True, "engine": "torch", "device": "cpu", "max_streams": 8, **overrides}
    service = build_service(Settings(cache_dir=home / "cache", data_dir=home / "data", **options))
    demo = build_demo(service)
    port = free_port()
    demo.launch(server_port=port, prevent_thread_lock=True, quiet=True, **launch_options(demo))
    try:
        yield RunningUI(service, demo, f"http://127.0.0.1:{port}/")
    finally:
        demo.close()


@pytest.fixture(scope="session")
def ui(tmp_path_factory):
    """The app every page test shares."""
    with launched_ui(tmp_path_factory.mktemp("ui")) as running:
        yield running


@pytest.fixture(scope="session")
def recording() -> tuple[Path, str]:
    """A real voice prompt recording and its transcript."""
    return REPO / "assets" / "voices" / "zh-aishell-w0121.wav", "甚至出现交易几乎停滞的情况"


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    """pytest-playwright's browser, as Debian's Chromium (no `playwright install` download)."""
    if not CHROMIUM.is_file() or shutil.which(str(CHROMIUM)) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing (required under CI=true; apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} is not installed")
    return {**browser_type_launch_args, "executable_path": str(CHROMIUM), "args": CHROMIUM_ARGS}
