import asyncio
import json
import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch

# Gradio's upload cache of this test run alone (the servers the tests start inherit it): the page
# deletes cached uploads older than an hour, which must never reach another run's files.
os.environ.setdefault("GRADIO_TEMP_DIR", tempfile.mkdtemp(prefix="cosyapp-tests-gradio-"))

# Facts about the official CosyVoice2-0.5B files: each weight file's tensor names and shapes, and the
# yaml's hyperparameters (see data/README.md).
MANIFESTS = Path(__file__).resolve().parent / "data"


def _load_manifest(name: str) -> dict:
    data = json.loads((MANIFESTS / f"{name}.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("total_params") and not k.startswith("_")}


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op thread: the engines run torch in worker threads beside the test's own, and on the
    2 shared cores of the test machines more threads stall each other (seconds per tiny flow call)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: vLLM's AsyncLLM stays bound to the loop that first used it, and
    the engines' asyncio parts (queues, futures) to the loop that made them."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


_COMPILE_THREADS: list[str] = []


@pytest.fixture
def compile_threads() -> list[str]:
    """The names of the threads dynamo starts a compile on during the test (a start callback of
    dynamo's own, registered at the first use)."""
    from torch._dynamo import callback

    if not getattr(compile_threads, "registered", False):
        callback.on_compile_start(lambda _: _COMPILE_THREADS.append(threading.current_thread().name))
        compile_threads.registered = True
    _COMPILE_THREADS.clear()
    return _COMPILE_THREADS


@pytest.fixture
def fresh_compiles() -> None:
    """torch._dynamo.reset(), and every compiling.Deferred forgets the kinds it had compiled (or failed
    to), so its next call of each kind goes to the compile thread again rather than compiling where
    it is made: for tests that count graphs from none."""
    import gc

    import torch._dynamo

    from cosyapp.engine.token2wav.compiling import Deferred

    torch._dynamo.reset()
    # type(o), not isinstance: some of torch's deprecated objects warn when asked their __class__
    for fn in [o for o in gc.get_objects() if issubclass(type(o), Deferred)]:
        fn.ready.clear()
        fn.failed.clear()


@pytest.fixture(scope="session")
def manifest():
    """manifest("llm.pt") -> {tensor name: shape}; manifest("cosyvoice2.yaml") -> the yaml's values."""
    return _load_manifest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight model folder in the official layout, written once per test session."""
    from cosyapp.modelgen.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """The tiny model loaded on CPU through the user-facing loader."""
    from cosyapp.models.checkpoint import load_model

    return load_model(tiny_model_dir, device="cpu")


@pytest.fixture(scope="module")
def url(service):
    """The app of the module's ``service`` fixture, served by uvicorn on a free loopback port."""
    from cosyapp.web.server import build_app, serve_in_thread

    with serve_in_thread(build_app(service)) as base:
        yield base
